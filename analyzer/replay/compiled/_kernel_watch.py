"""The first non-finite Inductor kernel of one compiled run, mapped to its ATen ops and source lines.

Inductor's CPU kernels do not dispatch per op and its ``nan_asserts`` check only a compiled
graph's inputs and outputs, but every compiled graph runs from a generated Python module (its
``call(args)``, loaded through ``torch._inductor.codecache.PyCodeCache``) that calls each kernel
by a module-level name: ``cpp_fused_mul_pow_rsub_1(buf0, buf1, ...)`` or
``extern_kernels.mm(a, b, out=buf2)``, whose outputs are their (mutated) tensor arguments. Within
``watching_kernels()`` each such module is patched as it loads: every kernel it names is wrapped,
in call order, with ``torch.aminmax`` checks (which propagate NaN/Inf) of its inputs before and of
its tensor arguments after the call, until the first one holds a NaN/Inf. Inductor's provenance
(``config.trace.provenance_tracking_level = 1``) names, per kernel call, the post-grad FX nodes it
computes and their stack traces (the user's source lines); a post-grad pass that only reads the
graph gives each node's ATen op. The checks only read: the run's numerics are unchanged.

NB: provenance is filled only when Inductor generates the code, so the run compiles with the FX
graph and AOTAutograd caches off (its C++ kernels still come from Inductor's cache): about one
Inductor lowering more than a cached run. These are Inductor internals; where one is missing the
run goes unwatched and ``unavailable`` says why in one line. Triton (CUDA) kernels, launched by
``kernel.run(...)``, are not wrapped.

Example (the compiled-only NaN of ``tests/analyzer/replay/compile_models.py``'s ``GateNet``):
    >>> with watching_kernels() as watch:  # doctest: +SKIP
    ...     loss = compiled_model(x).float().pow(2).mean(); loss.backward()
    >>> watch.first  # doctest: +SKIP
    {'kernel': 'cpp_fused__to_copy_mul_pow_rsub_1', 'handle': 'cpp_fused__to_copy_mul_pow_rsub_1:3',
     'graph': 'forward', 'aot_id': '1_forward',
     'ops': ['aten.mul', 'aten.sub', 'aten.pow', 'prims.convert_element_type'],
     'nodes': ['mul', 'mul_1', 'sub', 'pow_1', 'convert_element_type_4', 'convert_element_type_5'],
     'sources': ['tests/analyzer/replay/compile_models.py:37', 'tests/analyzer/replay/compile_models.py:38',
                 'tests/analyzer/replay/compile_models.py:48'],
     'inputs_finite': True, 'output_kind': 'nan', 'where': 'kernel'}
"""
from __future__ import annotations

import ast
import contextlib
import math
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..runs._attribution import shown_source

__all__ = ["KernelWatch", "watching_kernels"]

_HANDLE = re.compile(r"^\s*# \[Provenance debug handles\] (\S+)\s*$")
_PYBINDING = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\((\[[^\]]*\])", re.M)
_AOT_ID = re.compile(r"^# AOT ID: \['([^']+)'\]", re.M)
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in ')
_CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class KernelWatch:
    """What one watched compiled run saw.

    Attributes:
        first: the first non-finite event (see ``_event``), or None while every checked kernel is finite.
        checked: kernel calls checked.
        graphs: compiled graphs (generated modules) patched.
        unwatched: kernels those graphs launch that are not wrapped (Triton's ``kernel.run``).
        unavailable: why nothing is watched (an Inductor internal missing in this torch), else None.
    """

    first: dict | None = None
    checked: int = 0
    graphs: int = 0
    unwatched: int = 0
    unavailable: str | None = None
    _pending: list[dict] = field(default_factory=list)  # post-grad graphs not yet matched to a module
    _undo: list[tuple[Any, str, Any]] = field(default_factory=list)  # (module, name, original) to restore

    def post_grad_pass(self, graph: torch.fx.Graph) -> None:
        """Reads (never changes) a post-grad graph: node name -> ATen op, in graph order."""
        self._pending.append({n.name: _op_name(n.target) for n in graph.nodes if n.op == "call_function"})

    def on_load(self, mod: Any) -> None:
        """Patches one generated module as it loads; any surprise leaves it unpatched and says so."""
        try:
            self._patch(mod)
        except Exception as e:  # noqa: BLE001 - the compiled run must go on unwatched, never fail here
            self.unavailable = f"Inductor's generated code did not have the expected shape ({type(e).__name__}: {e})"

    def _patch(self, mod: Any) -> None:
        path = getattr(mod, "__file__", None)
        if not path or not callable(getattr(mod, "call", None)) or any(m is mod for m, _, _ in self._undo):
            return  # NB: PyCodeCache hands out one module object per file: patch it once
        nodes = self._pending.pop() if self._pending else {}  # the post-grad graph this module was generated from
        self._pending.clear()
        with open(path, encoding="utf-8") as f:
            src = f.read()
        sites = _call_sites(src.splitlines())
        if not sites:
            return
        from torch._inductor import debug

        aot = _AOT_ID.search(src)
        graph = _Graph(path=path, aot_id=aot.group(1) if aot else None, sites=sites, ops=nodes,
                       argtypes={m.group(1): ast.literal_eval(m.group(2)) for m in _PYBINDING.finditer(src)},
                       provenance={k: (list(debug._inductor_triton_kernel_to_post_grad_node_info.get(k, [])),
                                       list(debug._inductor_kernel_stack_trace.get(k, []))) for k in sites.values()})
        names = {k.rsplit(":", 1)[0] for k in sites.values()}
        for top in {n.split(".", 1)[0] for n in names}:
            obj = getattr(mod, top, None)
            if obj is None or hasattr(obj, "run"):  # a Triton launcher: kernel.run(...) is not wrapped
                self.unwatched += 1
                continue
            wrapped = self._wrap(obj, top, graph) if top in names else _Namespace(obj, top, names, self, graph)
            self._set(mod, top, wrapped)
        self._set(mod, "call", self._wrap_graph(mod.call, graph))
        self.graphs += 1

    def _set(self, mod: Any, name: str, value: Any) -> None:
        self._undo.append((mod, name, getattr(mod, name)))
        setattr(mod, name, value)

    def restore(self) -> None:
        """Every patched module as it loaded: PyCodeCache keeps them for later runs."""
        for mod, name, original in reversed(self._undo):
            setattr(mod, name, original)
        self._undo.clear()

    def _wrap(self, fn: Callable, name: str, graph: _Graph) -> Callable:
        types = graph.argtypes.get(name)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            if self.first is not None:
                return fn(*args, **kwargs)
            frame = sys._getframe(1)
            key = graph.sites.get(frame.f_lineno) if frame.f_code.co_filename == graph.path else None
            if key is None:  # called from another line than its comment's: by name, when the name is unique
                keys = [k for k in graph.sites.values() if k.rsplit(":", 1)[0] == name]
                key = keys[0] if len(keys) == 1 else None
            ins = [a for i, a in enumerate(args) if types is None or (i < len(types) and types[i].startswith("const"))]
            inputs_finite = _nonfinite(ins) is None
            out = fn(*args, **kwargs)
            self.checked += 1
            bad = _nonfinite([*args, *kwargs.values(), out])
            if bad is not None:
                self.first = _event(graph, name, key, bad, inputs_finite)
            return out

        return kernel

    def _wrap_graph(self, call: Callable, graph: _Graph) -> Callable:
        def watched(args: list) -> Any:
            if self.first is None:
                bad = _nonfinite(args)
                if bad is not None:
                    self.first = dict(_event(graph, None, None, bad, False), where="input")
            out = call(args)  # NB: call() empties `args`
            if self.first is None:
                bad = _nonfinite(out if isinstance(out, (list, tuple)) else [out])
                if bad is not None:
                    self.first = dict(_event(graph, None, None, bad, True), where="output")
            return out

        return watched


@dataclass(frozen=True)
class _Graph:
    """One generated module: where it calls each kernel and what Inductor's provenance says of them."""

    path: str
    aot_id: str | None
    sites: dict[int, str]  # line of a kernel call -> its provenance key ("cpp_fused_mul_0:3")
    ops: dict[str, str]  # post-grad node name -> ATen op
    argtypes: dict[str, list[str]]  # C++ kernel -> its arguments' C types ("const float*" is an input)
    provenance: dict[str, tuple[list[str], list[str]]]  # key -> (post-grad node names, stack traces)


class _Namespace:
    """``extern_kernels`` (or ``aten``) with the kernels the module calls through it wrapped."""

    def __init__(self, obj: Any, prefix: str, names: set[str], watch: KernelWatch, graph: _Graph):
        self._obj, self._prefix, self._names, self._watch, self._graph = obj, prefix, names, watch, graph

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._obj, attr)
        full = f"{self._prefix}.{attr}"
        if full in self._names:
            return self._watch._wrap(value, full, self._graph)
        if any(n.startswith(full + ".") for n in self._names):
            return _Namespace(value, full, self._names, self._watch, self._graph)
        return value


def _call_sites(lines: list[str]) -> dict[int, str]:
    """Line number (1-based) of each kernel call -> the provenance key of the comment above it."""
    sites: dict[int, str] = {}
    for i, line in enumerate(lines):
        m = _HANDLE.match(line)
        if m is None:
            continue
        j = i + 1
        while j < len(lines) and lines[j].lstrip().startswith("#"):
            j += 1
        sites[j + 1] = m.group(1)
    return sites


def _op_name(target: Any) -> str:
    """``aten.mul.Tensor`` -> ``aten.mul`` (the eager trace's names carry no overload)."""
    name = str(target)
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) >= 3 and parts[0] in ("aten", "prims") else name


def _nonfinite(values: list) -> str | None:
    """"nan" or "inf" for the first float tensor among `values` that holds one, else None."""
    for t in values:
        if isinstance(t, torch.Tensor) and t.dtype in _CHECKED and t.numel() > 0:
            lo, hi = torch.aminmax(t)  # propagates NaN/Inf; NB: a host sync per tensor (a diagnostic run)
            lo, hi = float(lo), float(hi)
            if math.isnan(lo) or math.isnan(hi):
                return "nan"
            if math.isinf(lo) or math.isinf(hi):
                return "inf"
    return None


def _event(graph: _Graph, name: str | None, key: str | None, kind: str, inputs_finite: bool) -> dict:
    """The JSON-ready record of the first non-finite kernel (or graph input/output when `name` is None)."""
    nodes, stacks = graph.provenance.get(key, ([], [])) if key else ([], [])
    order = {n: i for i, n in enumerate(graph.ops)}
    ordered = sorted(nodes, key=lambda n: order.get(n, len(order)))
    ops = list(dict.fromkeys(graph.ops[n] for n in ordered if n in graph.ops))
    in_backward = torch._C._current_graph_task_id() != -1
    return {"kernel": name, "handle": key, "graph": "backward" if in_backward else "forward",
            "aot_id": graph.aot_id, "ops": ops, "nodes": ordered, "sources": _sources(stacks),
            "inputs_finite": inputs_finite, "output_kind": kind, "where": "kernel"}


def _sources(stacks: list[str]) -> list[str]:
    """The innermost frame of each stack trace as ``file:line``, each once, in line order per file."""
    found: list[tuple[str, int]] = []
    for s in stacks:
        frames = _FRAME.findall(s)
        if frames:
            file, line = frames[-1]
            if (file, int(line)) not in found:
                found.append((file, int(line)))
    return [shown_source(f, n) for f, n in sorted(found)]


@contextlib.contextmanager
def watching_kernels() -> Iterator[KernelWatch]:
    """Within: every Inductor module compiled and loaded is watched (see the module doc); restored after."""
    watch = KernelWatch()
    try:
        from torch._functorch import config as functorch_config
        from torch._inductor import config, debug
        from torch._inductor.codecache import PyCodeCache
        from torch._inductor.custom_graph_pass import get_custom_graph_passes

        original = PyCodeCache.__dict__["load_by_key_path"]
        passes = (*get_custom_graph_passes(config.post_grad_custom_post_pass), watch.post_grad_pass)
        patches = [config.patch({"trace.provenance_tracking_level": 1, "fx_graph_cache": False,
                                 "post_grad_custom_post_pass": passes}),
                   functorch_config.patch(enable_autograd_cache=False), debug.reset_provenance_globals()]
    except Exception as e:  # noqa: BLE001 - another torch: run unwatched, say so once
        watch.unavailable = f"Inductor's kernel provenance is not available in torch {torch.__version__} ({e})"
        yield watch
        return
    load = original.__func__

    def load_and_watch(cls: type, *args: Any, **kwargs: Any) -> Any:
        mod = load(cls, *args, **kwargs)
        watch.on_load(mod)
        return mod

    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        PyCodeCache.load_by_key_path = classmethod(load_and_watch)
        try:
            yield watch
        finally:
            PyCodeCache.load_by_key_path = original
            watch.restore()

"""The hooks a counterfactual fix installs on one replay run: module in FP32, op in FP32, guards.

Each hook changes exactly one thing about the replayed step, the way a user's one-line edit
would, without touching the user's code:

- ``module_fp32``: a forward pre-hook on the culprit's module (and on every other instance of
  its class) enters ``torch.autocast(device_type, enabled=False)`` and upcasts its FP16/BF16
  inputs; the forward hook leaves the autocast region again (``always_call``, so an exception
  cannot leak it).
- ``op_fp32_override``: the culprit op alone, matched by its index in the run, computed from
  FP32 copies of its inputs inside the dispatch mode, its result cast back to the dtype the op
  produces. Below autograd, so the backward formula is the op's own.
- ``_GuardMode``: a ``TorchFunctionMode`` that clamps (or adds eps to) one argument of every
  call of the guarded function issued from the culprit's source line, as if the user edited
  that line. It works above autograd, so the guard is part of the graph and its backward too.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ..runs._attribution import user_source

__all__: list[str] = []

_LOW = (torch.float16, torch.bfloat16)

# The culprit op's base name (forward) or its backward node's prefix -> the torch functions a
# user calls to get it, by ``__name__``.
GUARDED = {
    "log": ("log",), "log2": ("log2",), "log10": ("log10",),
    "sqrt": ("sqrt",), "rsqrt": ("rsqrt",),
    "div": ("div", "divide", "true_divide", "__truediv__", "__rtruediv__", "__div__"),
    "acos": ("acos", "arccos"),
    "pow": ("pow", "__pow__"),
}


class ModuleNotFound(LookupError):
    """The culprit's module path does not exist in the rebuilt model."""


def _upcast(x):
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in _LOW else x


@contextmanager
def module_fp32(model: torch.nn.Module, path: str, device_type: str, names: list[str]) -> Iterator[None]:
    """Run the module at `path` (``"<model>"``: the root), and every module of its class, with
    autocast off and FP32 inputs; `names` gets their paths.

    Every instance of the class, because the user's fix is an edit of the class (its forward
    wrapped in ``torch.autocast(..., enabled=False)``), which every instance runs: in a GPT the
    next block's attention overflows as soon as the first one is fixed.
    """
    named = dict(model.named_modules())
    target = named.get("" if path == "<model>" else path)
    if target is None:
        raise ModuleNotFound(path)
    chosen = [(n, m) for n, m in named.items() if type(m) is type(target)]
    names.extend(n or "<model>" for n, _ in chosen)
    regions: list = []

    def pre(_mod, args, kwargs):
        region = torch.autocast(device_type, enabled=False)
        region.__enter__()
        regions.append(region)
        return tree_map(_upcast, args), tree_map(_upcast, kwargs)

    def post(_mod, _args, _kwargs, _out):
        if regions:
            regions.pop().__exit__(None, None, None)

    handles = []
    for _, m in chosen:
        handles += [m.register_forward_pre_hook(pre, with_kwargs=True),
                    m.register_forward_hook(post, with_kwargs=True, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while regions:  # a forward that raised before the post hook ran
            regions.pop().__exit__(None, None, None)


def op_fp32_override(index: int, op: str, out_dtype: torch.dtype | None, hits: list[int]) -> dict:
    """An ``op_override`` for ``run_once``: op `index` (named `op`) computed in FP32, cast back.

    `hits` gets the index when the override fired on the expected op: a run whose ops differ
    from the diagnosed one (a different op at that index) leaves it empty.
    """
    def fn(func, args, kwargs):
        if str(func.overloadpacket) != op or func._schema.is_mutable:
            return func(*args, **kwargs)
        hits.append(index)
        up_args, up_kwargs = tree_map(_upcast, (args, kwargs))
        out = func(*up_args, **up_kwargs)
        if out_dtype not in _LOW:
            return out
        return tree_map(lambda t: t.to(out_dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t,
                        out)
    return {index: fn}


def guard_target(args: tuple, name: str) -> int | None:
    """Which positional argument a guard changes: the denominator of a division, else the input."""
    pos = 0
    if name in ("div", "divide", "true_divide", "__truediv__", "__div__"):
        pos = 1
    if pos < len(args) and isinstance(args[pos], torch.Tensor) and args[pos].is_floating_point():
        return pos
    return None


def guarded(x: torch.Tensor, base: str, kind: str) -> torch.Tensor:
    """`x` moved away from `base`'s singular point: ``kind`` is ``"clamp"`` or ``"eps"``.

    log, sqrt, rsqrt: ``clamp_min(finfo.tiny)`` or ``+ finfo.eps``; div, pow: away from 0 with
    the sign kept; acos: into ``[-1 + eps, 1 - eps]`` (clamp only).
    """
    fi = torch.finfo(x.dtype)
    if base == "acos":
        return x.clamp(-1 + fi.eps, 1 - fi.eps)
    if base in ("div", "pow"):
        if kind == "clamp":
            return torch.where(x < 0, x.clamp_max(-fi.tiny), x.clamp_min(fi.tiny))
        return x + torch.where(x < 0, -fi.eps, fi.eps)
    return x.clamp_min(fi.tiny) if kind == "clamp" else x + fi.eps


class _GuardMode(TorchFunctionMode):
    """Guard every forward call of the functions `names` made from the source line `source`."""

    def __init__(self, names: tuple[str, ...], base: str, kind: str, source: str):
        super().__init__()
        self.names, self.base, self.kind, self.source = frozenset(names), base, kind, source
        self.hits = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (getattr(func, "__name__", None) in self.names and torch._C._current_graph_task_id() == -1
                and user_source() == self.source):
            pos = guard_target(args, func.__name__)
            if pos is not None and (self.base != "pow" or _negative_or_fractional(args)):
                args = (*args[:pos], guarded(args[pos], self.base, self.kind), *args[pos + 1:])
                self.hits += 1
        return func(*args, **kwargs)


def _negative_or_fractional(args: tuple) -> bool:
    """pow's derivative is infinite at a base of 0 only for an exponent below 1."""
    e = args[1] if len(args) > 1 else None
    if isinstance(e, (int, float)):
        return e < 1
    return isinstance(e, torch.Tensor)  # a tensor exponent: guard, it may hold such values


@contextmanager
def guard_mode(names: tuple[str, ...], base: str, kind: str, source: str, seen: list[int]) -> Iterator[None]:
    """Push a ``_GuardMode`` for one run; `seen` gets the number of guarded calls at the end."""
    mode = _GuardMode(names, base, kind, source)
    try:
        with mode:
            yield
    finally:
        seen.append(mode.hits)

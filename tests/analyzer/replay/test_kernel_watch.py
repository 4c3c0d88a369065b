"""The kernel watch's reading of Inductor-generated modules, without Inductor: real files, real tensors.

The compiled runs that exercise it against Inductor's own code are in test_compiled_replay.py
(marked ``compile``); these check what it makes of a module file: the first kernel that writes a
NaN/Inf is named by its provenance comment, and any file content is patched or refused in one
line, never raised, and restored afterwards.
"""
from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.replay.compiled._kernel_watch import KernelWatch, _sources

GENERATED = '''# AOT ID: ['0_forward']
def call(args):
    x, buf0, buf1 = args
    args.clear()
    # [Provenance debug handles] cpp_fused_mul_0:1
    cpp_fused_mul_0(x, buf0)
    # [Provenance debug handles] extern_kernels.log:2
    extern_kernels.log(buf0, out=buf1)
    return (buf1, )
'''


def _load(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"generated_{path.parent.name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_first_kernel_that_writes_a_nan_is_named_by_its_provenance_comment(tmp_path):
    path = tmp_path / "generated.py"
    path.write_text(GENERATED)
    mod = _load(path)
    mod.cpp_fused_mul_0 = lambda x, out: out.copy_(x * 2)  # finite: -2, 4
    mod.extern_kernels = types.SimpleNamespace(log=lambda a, out: torch.log(a, out=out))  # log(-2): NaN
    watch = KernelWatch()
    watch.on_load(mod)
    assert watch.unavailable is None and watch.graphs == 1
    out = mod.call([torch.tensor([-1.0, 2.0]), torch.empty(2), torch.empty(2)])
    assert torch.isnan(out[0][0])  # the watch only reads: the module computes what it computed
    first = watch.first
    assert (first["kernel"], first["handle"]) == ("extern_kernels.log", "extern_kernels.log:2")
    assert first["output_kind"] == "nan"
    assert first["inputs_finite"] and first["where"] == "kernel" and first["aot_id"] == "0_forward"
    assert watch.checked == 2  # cpp_fused_mul_0 finite, then the log
    watch.restore()
    assert not hasattr(mod.extern_kernels, "_obj")  # the namespace as it was


def test_the_sources_are_the_innermost_frame_of_each_stack_trace():
    trace = ('  File "/w/model.py", line 39, in forward\n    return self.head(self.gate(x))\n'
             '  File "/w/model.py", line 29, in forward\n    return (1 - c * c) ** 1.5\n')
    assert _sources([trace, trace, 'no frame here']) == ["/w/model.py:29"]


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
_NAME = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
_LINE = st.one_of(
    _TEXT,
    _NAME.map(lambda k: f"    # [Provenance debug handles] {k}:1"),
    st.tuples(_NAME, _TEXT).map(lambda p: f"{p[0]}.{p[0]} = async_compile.cpp_pybinding([{p[1]}], r'''"),
    st.tuples(_NAME, _TEXT).map(lambda p: f"{p[0]} = async_compile.cpp_pybinding([{p[1]!r}], r'''"),
    st.just("# AOT ID: ['0_forward']"),
    _NAME.map(lambda n: f"    {n}(buf0, buf1)"),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_LINE, max_size=16), names=st.lists(_NAME, max_size=4))
def test_any_generated_module_file_is_patched_or_refused_in_one_line_and_restored(tmp_path, lines, names):
    path = tmp_path / "generated.py"
    path.write_text("\n".join(lines), encoding="utf-8")
    mod = types.ModuleType("generated")
    mod.__file__ = str(path)
    mod.call = lambda args: args
    for n in names:
        setattr(mod, n, lambda *a, **k: "ran")
    before = dict(vars(mod))
    watch = KernelWatch()
    watch.on_load(mod)  # never raises: the compiled run goes on, watched or not
    assert watch.unavailable is None or "\n" not in watch.unavailable
    assert mod.call([1]) == [1]
    for n in names:
        assert getattr(mod, n)(torch.tensor([1.0])) == "ran"  # wrapped or not, each kernel still runs
    watch.restore()
    assert vars(mod) == before

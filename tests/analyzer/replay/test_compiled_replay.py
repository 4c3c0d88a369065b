"""A torch.compile'd (Inductor) model recorded as users do, replayed as training ran: eager precisions plus the step compiled.

Three real FP16 runs (compile_models.py): a compiled-only NaN (``compile_specific`` names the
smallest module and the first non-finite Inductor kernel, and excluding the module from compilation
is verified), the eager-only overflow of ``(h * 512) * 512 / 262144`` (training's compiled step is
finite; the eager overflow is labelled eager-only and never headlined), and a dropout step whose
NaN only the mask decides (the compiled replay draws training's masks; a mask difference is never
called ``compile_specific``). Where Inductor cannot build the kernels (no C++ compiler), the run
is recorded with the compiled model but stepped eager, and the replay must say "compiled step not
reproduced" with the eager verdict standing.
"""
from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main
from analyzer.replay import Replay
from analyzer.replay.verdicts import registry as verdicts
from recorders import Recorder
from analyzer.replay.compiled.replay import _kernel_fields
from analyzer.replay.compiled._run import compiled_once
from tests.analyzer.replay.compile_models import (Gate, build_chain_net, build_drop_gate_net, build_drop_net,
                                                  build_gate_net, chain_batch, drop_batch, drop_seeds,
                                                  fresh_inductor, gate_batch, mse_loss)

pytestmark = pytest.mark.compile

MODELS = "tests.analyzer.replay.compile_models"


def _record(run: Path, build, batch: dict, *, eager_steps: bool) -> tuple[Path, bool]:
    """One FP16 step of ``torch.compile(build())`` (GradScaler at its default scale), as a user loop writes it.

    Its snapshot: the step's own (a non-finite loss) or, for a finite step, a manual one of the next.
    With `eager_steps` the loop steps the original module: the recorder still sees the compiled model.
    """
    model = torch.compile(build())
    step_model = model._orig_mod if eager_steps else model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with Recorder(run, model, factory=f"{MODELS}:{build.__name__}", loss_fn=f"{MODELS}:mse_loss", scaler=scaler,
                  amp_dtype=torch.float16, optimizer=opt) as rec:
        rec.begin_step(0, batch)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mse_loss(step_model, batch)
        scaler.scale(loss).backward()
        rec.end_step(loss)
        scaler.step(opt)
        scaler.update()
        snaps = sorted((run / "snapshots").glob("*.pt"))
        if not snaps:
            rec.begin_step(1, batch)
            snaps = [Path(rec.snapshot())]
    return snaps[0], bool(torch.isfinite(loss))


def _recorded(tmp: Path, build, batch: dict) -> tuple[Path, bool, bool]:
    """(snapshot, whether Inductor built the training step here, whether the trained loss was finite)."""
    for fresh in (False, True):
        try:
            with fresh_inductor(fresh):
                run = tmp / ("compiled-fresh" if fresh else "compiled")
                path, finite = _record(run, build, batch, eager_steps=False)
            return path, True, finite
        except torch._dynamo.exc.BackendCompilerFailed:
            continue
    path, finite = _record(tmp / "eager-stepped", build, batch, eager_steps=True)  # no C++ compiler, ...
    return path, False, finite


@pytest.fixture(scope="session")
def gate(tmp_path_factory):
    path, built, finite = _recorded(tmp_path_factory.mktemp("gate"), build_gate_net, gate_batch())
    replay = Replay(path)
    result = replay.run()
    return path, built, finite, result, replay.try_fixes(result)


@pytest.fixture(scope="session")
def chain(tmp_path_factory):
    path, built, finite = _recorded(tmp_path_factory.mktemp("chain"), build_chain_net, chain_batch())
    replay = Replay(path)
    result = replay.run()
    return path, built, finite, result, replay.try_fixes(result)


def _not_reproduced(result) -> None:
    assert result.compiled["reproduced"] is False
    assert result.compiled["note"].startswith("compiled step not reproduced: ")


def test_the_compiled_run_is_the_diagnosis_evidence_its_verdict_and_summary_are_worded_from(gate):
    _path, built, _finite, result, _fixes = gate
    ev = result.diagnosis.evidence["compiled"]  # the registered probe ``compiled``'s evidence
    assert result.compiled == dict(ev.info) and ev.specific is built
    assert result.verdict == ("compile_specific" if built else "healthy")
    assert result.summary == verdicts.summary(result.diagnosis)  # worded once, nothing appended afterwards
    if built:
        assert result.diagnosis.culprit is ev.culprit and result.culprit_trace is None


def test_a_compiled_only_nan_names_the_smallest_module_and_excluding_it_from_compilation_is_verified(gate):
    path, built, finite, result, fixes = gate
    assert result.runs["float32"]["finite"] and result.runs["float16"]["finite"]  # eager: every precision finite
    if not built:  # this machine's Inductor cannot build the kernels: the eager verdict stands, marked
        _not_reproduced(result)
        assert result.verdict == "healthy"
        return
    assert not finite and path.name.endswith("nonfinite_loss.pt")  # training's compiled step was NaN
    assert result.verdict == "compile_specific"
    cmp = result.compiled
    assert cmp["reproduced"] and not cmp["forward_finite"] and cmp["eager_finite"]
    assert cmp["module"] == "gate" and cmp["phase"] == "forward"  # not the model, not its child gate.proj
    assert {t["module"]: t["finite"] for t in cmp["tried"]} == {"gate": False, "gate.proj": True}
    assert result.culprit["module"] == "gate" and result.culprit["op"] == "<compiled>"
    assert "compiling `gate` alone" in result.summary
    assert {o["op"] for o in cmp["ops"]} >= {"aten.mm", "aten.rsub", "aten.pow"}  # gate's arithmetic, eager's names
    assert {o["module"] for o in cmp["ops"]} <= {"gate", "gate.proj"}
    assert [(f.name, f.status) for f in fixes] == [("compile_disable", "verified")]


def test_the_compiled_only_nan_names_its_first_non_finite_kernel_with_its_aten_ops_and_source_lines(gate):
    path, built, finite, result, fixes = gate
    if not built:
        pytest.skip("Inductor cannot build kernels here: no kernel runs to watch")
    cmp = result.compiled
    assert cmp["random"] is None  # GateNet draws no random numbers: one compiled run, nothing to compare masks of
    k = cmp["kernel"]
    assert k is not None, cmp["kernel_note"]
    # Gate.forward's `(1 - c * c) ** 1.5` fused into one C++ kernel; its output is the NaN (FP32 1 - c*c < 0)
    assert k["kernel"].startswith("cpp_fused") and k["graph"] == "forward" and k["output_kind"] == "nan"
    assert k["inputs_finite"] and k["where"] == "kernel"
    assert {"aten.mul", "aten.sub", "aten.pow"} <= set(k["ops"])  # post-grad ops: rsub is a sub there
    lines = {s.rsplit(":", 1)[1] for s in k["sources"] if s.startswith("tests/analyzer/replay/compile_models.py:")}
    code, first = inspect.getsourcelines(Gate.forward)
    want = {str(first + i) for i, text in enumerate(code) if "* 1.0001" in text or "** 1.5" in text}
    assert len(want) == 2 and want <= lines  # `c = self.proj(x) * 1.0001` and `return (1 - c * c) ** 1.5`
    assert f"the first kernel whose output holds NaN/Inf is {k['kernel']} (forward graph, from finite inputs)" \
        in result.summary
    res = CliRunner().invoke(main, ["replay", str(path)])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("  kernel    "))
    assert line.startswith(f"  kernel    {k['kernel']} (forward graph): first NaN/Inf output; aten.mul")
    assert f"compile_models.py:{max(want)}" in line
    out = json.loads(CliRunner().invoke(main, ["replay", str(path), "--json"]).output)
    assert out["compiled"]["kernel"]["kernel"] == k["kernel"] and out["compiled"]["kernel"]["sources"] == k["sources"]


def test_the_eager_only_overflow_replays_as_training_ran_and_is_never_the_headline(chain):
    path, built, finite, result, fixes = chain
    assert finite is built  # training's compiled step: a finite loss (stepped eager, the overflow's NaN)
    assert not result.runs["float16"]["forward_finite"]  # the eager FP16 forward overflows
    if not built:
        _not_reproduced(result)
        assert result.verdict == "overflow" and result.culprit["module"] == "chain"
        return
    assert result.verdict == "compile_specific" and result.culprit is None
    cmp = result.compiled
    assert cmp["finite"] and cmp["eager_only"]["verdict"] == "overflow" and cmp["eager_only"]["module"] == "chain"
    assert result.summary.startswith("Training's compiled step has a finite loss in float16")
    assert "eager-only: Inductor computes this fused chain in FP32" in result.summary
    assert fixes == []  # nothing to fix in the step training ran


def test_replay_text_of_the_eager_only_overflow_heads_with_the_finite_compiled_step(chain):
    path, built, *_ = chain
    res = CliRunner().invoke(main, ["replay", str(path)])
    assert res.exit_code == 0, res.output
    head = res.output.splitlines()[:2]
    compiled = next(line for line in res.output.splitlines() if line.startswith("  compiled  "))
    if built:
        assert head[0] == "verdict: compile_specific" and "Training's compiled step has a finite loss" in head[1]
        assert "finite (inductor: the whole model)" in compiled
    else:
        assert compiled.startswith("  compiled  compiled step not reproduced: ")
    assert "_orig_mod" not in res.output


def test_autopsy_of_the_compiled_only_nan_heads_with_the_module_and_its_verified_fix(gate):
    path, built, *_ = gate
    res = CliRunner().invoke(main, ["autopsy", str(path.parent.parent)])
    assert res.exit_code == 0, res.output
    if not built:  # stepped eager, the run is finite: no failure snapshot for autopsy to replay
        assert "root cause: no failing step" in res.output
        return
    root = next(line for line in res.output.splitlines() if "root cause:" in line)
    assert "compile_specific" in root and "compiling `gate` alone" in root
    assert "the first kernel whose output holds NaN/Inf is cpp_fused" in root
    assert "verified fix: exclude `gate` from compilation" in res.output
    assert "_orig_mod" not in res.output


def test_without_a_cpp_compiler_the_compiled_step_is_not_reproduced_and_the_eager_verdict_stands(chain):
    path = chain[0]
    with torch._inductor.config.patch({"cpp.cxx": (None, "/nonexistent/c++")}):  # no compiler to find
        res = CliRunner().invoke(main, ["replay", str(path), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["verdict"] == "overflow" and out["culprit"]["module"] == "chain"
    assert out["compiled"]["reproduced"] is False
    assert out["compiled"]["note"] == ("compiled step not reproduced: no C++ compiler found (CPU Inductor needs one: "
                                       "install g++ or set CXX); the eager verdict stands")


def test_blocks_compiled_in_place_are_searched_one_entry_at_a_time(tmp_path):
    """torchtitan's way: ``block.compile()`` per block. Each recorded entry is compiled alone first."""
    model = build_gate_net()
    model.head.compile()
    model.gate.compile()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler, batch = torch.amp.GradScaler("cpu"), gate_batch()
    with Recorder(tmp_path / "run", model, factory=f"{MODELS}:build_gate_net", loss_fn=f"{MODELS}:mse_loss",
                  scaler=scaler, amp_dtype=torch.float16, optimizer=opt) as rec:
        rec.begin_step(0, batch)
        path = Path(rec.snapshot())  # before the step: this test is about the replay's search, not training
    result = Replay(path).run()
    entries = [(m["path"], m["how"]) for m in result.compiled["modules"]]
    assert sorted(entries) == [("gate", "module.compile"), ("head", "module.compile")]
    if not result.compiled["reproduced"]:  # Inductor cannot build kernels here
        _not_reproduced(result)
        assert result.verdict == "healthy"
        return
    assert result.verdict == "compile_specific" and result.compiled["module"] == "gate"
    tried = [(t["module"], t["finite"]) for t in result.compiled["tried"]]
    assert ("gate", False) in tried and ("gate.proj", True) in tried
    assert tried.index(("gate", False)) < tried.index(("gate.proj", True))  # the entry first, then its children


def test_watching_the_kernels_leaves_the_compiled_step_bit_identical(chain):
    path, built, *_ = chain
    if not built:
        pytest.skip("Inductor cannot build kernels here")
    replay = Replay(path)
    ctx = replay.context()
    modules = replay.snapshot.compile["modules"]
    plain = compiled_once(ctx, modules, "float16", 65536.0)
    watched = compiled_once(ctx, modules, "float16", 65536.0, watch=True)
    assert plain.kernels is None and watched.kernels["unavailable"] is None
    assert watched.kernels["first"] is None and watched.kernels["checked"] > 0  # ChainNet's compiled step is finite
    assert watched.trace.loss == plain.trace.loss  # the checks only read: same bits
    assert watched.trace.grad_absmax == plain.trace.grad_absmax
    assert not plain.drew_random and not watched.drew_random



def test_a_backend_that_generates_no_inductor_code_leaves_no_kernel_to_name(gate):
    replay = Replay(gate[0])
    modules = [dict(m, backend="aot_eager") for m in replay.snapshot.compile["modules"]]  # eager kernels, traced
    out = compiled_once(replay.context(), modules, "float16", 65536.0, watch=True)
    assert out.trace is not None and out.trace.finite  # aot_eager computes as eager does: the gate stays finite
    assert out.kernels == {"first": None, "checked": 0, "graphs": 0, "unwatched": 0, "unavailable": None}
    assert _kernel_fields(out.kernels)["kernel_note"].startswith("no Inductor-generated code ran in the compiled step")

@pytest.fixture(scope="session")
def dropout(tmp_path_factory):
    """Two FP16 steps of ``torch.compile(build_drop_net())``: a finite one (a manual snapshot before it) and
    one whose compiled mask drops the element the log reads (NaN) where eager's mask keeps it."""
    for fresh in (False, True):
        try:
            with fresh_inductor(fresh):
                return _dropout_run(tmp_path_factory.mktemp("dropout"))
        except torch._dynamo.exc.BackendCompilerFailed:
            continue
    pytest.skip("Inductor cannot build kernels here: no compiled masks to compare")


def _dropout_run(tmp: Path):
    model = torch.compile(build_drop_net())
    batch = drop_batch()
    ok, bad = drop_seeds(model, model._orig_mod, batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)  # the output is ~8: its FP16 backward fits at 256
    run = tmp / "run"
    losses = []
    with Recorder(run, model, factory=f"{MODELS}:build_drop_net", loss_fn=f"{MODELS}:mse_loss", scaler=scaler,
                  amp_dtype=torch.float16, optimizer=opt) as rec:
        for step, seed in enumerate((ok, bad)):
            torch.manual_seed(seed)
            rec.begin_step(step, batch)
            if step == 0:
                manual = Path(rec.snapshot())
            with torch.autocast("cpu", dtype=torch.float16):
                loss = mse_loss(model, batch)
            scaler.scale(loss).backward()
            rec.end_step(loss)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(float(loss.detach()))
    failing = next((run / "snapshots").glob("step00000001-*nonfinite*.pt"))
    return losses, Replay(manual).run(), Replay(failing).run()


def test_the_compiled_replay_of_a_dropout_step_draws_trainings_masks_and_compares_eager_under_eagers(dropout):
    losses, result, _ = dropout
    cmp = result.compiled
    assert cmp["reproduced"] and cmp["random"] is not None
    assert cmp["loss"] == pytest.approx(losses[0], rel=1e-6)  # training's compiled step, its masks, again
    eager = result.runs["float16"]["loss"]
    assert abs(eager - losses[0]) > 0.5  # eager's mask differs: a kept element moves the output by >= 2
    assert cmp["random"]["same_masks"]["loss"] == pytest.approx(eager, rel=1e-2)  # fallback_random: eager's masks
    assert cmp["random"]["masks_matter"] is False and result.verdict == "healthy"


def test_a_nan_only_trainings_dropout_mask_makes_is_not_called_compile_specific(dropout):
    losses, _, result = dropout
    assert not math.isfinite(losses[1])  # training's compiled step dropped the element the log reads
    cmp = result.compiled
    assert result.verdict == "healthy"  # eager's mask keeps it; compiled with eager's mask, finite too
    assert cmp["finite"] is False and not cmp["forward_finite"]  # the replayed compiled step: training's mask, NaN
    assert cmp["random"]["same_masks"]["finite"] and cmp["random"]["masks_matter"] is True
    assert "which elements dropout drops decides it, not compilation" in result.summary
    assert "with eager's dropout masks is finite too: the eager verdict stands" in cmp["note"]


def test_a_compiled_only_nan_beside_dropout_is_localized_and_fixed_with_eagers_masks(tmp_path):
    """The eager replay draws eager's masks: the compiled runs it is compared with (the step, the module
    search, the fix) draw the same ones, so the fix's loss can match the FP32 replay's."""
    path, built, finite = _recorded(tmp_path, build_drop_gate_net, gate_batch())
    if not built:
        pytest.skip("Inductor cannot build kernels here")
    replay = Replay(path)
    result = replay.run()
    cmp = result.compiled
    assert not finite and result.verdict == "compile_specific" and cmp["module"] == "gate"
    assert cmp["random"]["same_masks"]["finite"] is False and cmp["random"]["masks_matter"] is False
    assert cmp["kernel"] is not None and {"aten.sub", "aten.pow"} <= set(cmp["kernel"]["ops"])
    [fix] = replay.try_fixes(result)
    assert (fix.name, fix.status) == ("compile_disable", "verified"), fix.detail
    assert "with eager's dropout masks" in fix.detail


_STALE = """
import sys, torch
from analyzer.replay import Replay, verdicts
from analyzer.replay.compiled._run import compiled_once
from tests.analyzer.replay.compile_models import build_gate_net, gate_batch, mse_loss
try:  # training's way: torch.compile, Inductor's caches on
    with torch.autocast("cpu", dtype=torch.float16):
        mse_loss(torch.compile(build_gate_net()), gate_batch())
    print("plain: built")
except torch._dynamo.exc.BackendCompilerFailed:
    print("plain: build failed")
if len(sys.argv) > 1:
    replay = Replay(sys.argv[1])
    out = compiled_once(replay.context(), replay.snapshot.compile["modules"], "float16", 65536.0)
    print("replay:", "reproduced" if out.trace is not None else out.error)
"""


@pytest.mark.slow  # two fresh processes, three compiles: ~25 s on a 2-core CPU
def test_a_graph_cached_under_another_cpu_capability_is_generated_afresh_by_the_replay(gate, tmp_path):
    """Inductor's FX graph cache does not key on the ATen CPU capability: a graph cached with this CPU's
    vectorised kernels does not build under the portable ones. The replay's compiled run regenerates it."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT" or not gate[1]:
        pytest.skip("needs a vectorised CPU capability that Inductor builds for")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))  # shared by the two processes
    cached = subprocess.run([sys.executable, "-c", _STALE], env=env, capture_output=True, text=True, timeout=600)
    assert cached.stdout.splitlines() == ["plain: built"], cached.stderr[-2000:]
    portable = subprocess.run([sys.executable, "-c", _STALE, str(gate[0])], capture_output=True, text=True,
                              env=dict(env, ATEN_CPU_CAPABILITY="default"), timeout=600)
    # the premise (torch 2.13): the cached graph fails to build here; the replay builds it afresh
    assert portable.stdout.splitlines() == ["plain: build failed", "replay: reproduced"], portable.stderr[-2000:]

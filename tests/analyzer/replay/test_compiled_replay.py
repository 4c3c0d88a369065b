"""A torch.compile'd (Inductor) model recorded as users do, replayed as training ran: eager precisions plus the step compiled.

Two real FP16 runs (compile_models.py): a compiled-only NaN (``compile_specific`` names the
smallest module, and excluding it from compilation is verified) and the eager-only overflow of
``(h * 512) * 512 / 262144`` (training's compiled step is finite; the eager overflow is labelled
eager-only and never headlined). Where Inductor cannot build the kernels (the portable
``ATEN_CPU_CAPABILITY=default`` kernels, no C++ compiler), the run is recorded with the compiled
model but stepped eager, and the replay must say "compiled step not reproduced" with the eager
verdict standing.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main
from analyzer.replay import Replay
from recorders import Recorder
from tests.analyzer.replay.compile_models import build_chain_net, build_gate_net, chain_batch, gate_batch, mse_loss

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
    try:
        path, finite = _record(tmp / "compiled", build, batch, eager_steps=False)
        return path, True, finite
    except torch._dynamo.exc.BackendCompilerFailed:  # e.g. the portable kernels: no at::vec for Inductor's C++
        path, finite = _record(tmp / "eager-stepped", build, batch, eager_steps=True)
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

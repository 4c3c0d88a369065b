"""A torch.compile'd model that accumulates gradients: ``begin_step(step, [mb0, mb1, mb2, mb3])`` in a plain loop.

Two real FP16 runs, each recorded once per session:

- ``aot_eager`` (eager numerics): a NaN feature in micro-batch 2. The eager replay and the compiled
  replay both re-run all four micro-batches; the compiled run agrees with eager, the culprit names
  micro-batch 2 and the autopsy heads its answer with it.
- Inductor (its numerics matter): the compiled-only NaN of ``compile_models.build_gate_net``, fed
  an input of exactly 1 in micro-batch 2 only. ``compile_specific`` names the module and the
  micro-batch whose compiled forward left the domain.
"""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch

from analyzer.replay import Replay
from recorders import Recorder
from tests.analyzer.replay import replay_models as rm
from tests.analyzer.replay.compile_models import build_gate_net, fresh_inductor, mse_loss

pytestmark = pytest.mark.compile

MICRO, BAD = 4, 2
GATE = "tests.analyzer.replay.compile_models"


def _nan_micro_batches() -> list[dict]:
    g = torch.Generator().manual_seed(7)
    mbs = [{"x": torch.randn(4, 4, generator=g), "y": torch.randn(4, 1, generator=g)} for _ in range(MICRO)]
    mbs[BAD]["x"][1, 2] = float("nan")
    return mbs


def _gate_micro_batches() -> list[dict]:
    """Entries in [-0.75, 0.75] (finite compiled and eager), and one exact 1 in micro-batch `BAD` only
    (``compile_models``: compiled, 1 - c*c < 0 and its power 1.5 is NaN; eager FP16 rounds it to 0)."""
    g = torch.Generator().manual_seed(5)
    mbs = [{"x": torch.rand(2, 4, generator=g) * 1.5 - 0.75, "y": torch.zeros(2, 1)} for _ in range(MICRO)]
    mbs[BAD]["x"][0, 1] = 1.0
    return mbs


def _record(run: Path, model: torch.nn.Module, factory: str, loss_fn, loss_ref: str, mbs: list[dict], *,
            step_model: torch.nn.Module | None = None) -> Path:
    """One FP16 optimizer step over `mbs` as people write it: ``loss / N`` per micro-batch, GradScaler.
    `step_model` steps instead of `model` (the recorder still sees `model`)."""
    step_model = model if step_model is None else step_model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with Recorder(run, model, factory=factory, loss_fn=loss_ref, scaler=scaler, amp_dtype=torch.float16,
                  optimizer=opt, micro_batches=MICRO) as rec:
        rec.begin_step(0, mbs)
        total = 0.0
        for mb in mbs:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(step_model, mb) / MICRO
            scaler.scale(loss).backward()
            total = total + loss.detach()
        rec.end_step(total)
        scaler.step(opt)
        scaler.update()
        if not list((run / "snapshots").glob("*.pt")):  # a finite step (stepped eager): snapshot the next by hand
            rec.begin_step(1, mbs)
            rec.snapshot()
    [path] = sorted((run / "snapshots").glob("*.pt"))
    return path


@pytest.fixture(scope="session")
def aot_nan(tmp_path_factory):
    run = tmp_path_factory.mktemp("compiled_accum") / "run"
    model = torch.compile(rm.build_mlp(), backend="aot_eager")
    path = _record(run, model, f"{rm.REF}:build_mlp", rm.mse, f"{rm.REF}:mse", _nan_micro_batches())
    replay = Replay(path, device="cpu")
    return run, path, replay, replay.run()


@pytest.fixture(scope="session")
def gate_accum(tmp_path_factory):
    run = tmp_path_factory.mktemp("compiled_gate_accum") / "run"
    args = (f"{GATE}:build_gate_net", mse_loss, f"{GATE}:mse_loss", _gate_micro_batches())
    path = None
    for fresh in (False, True):  # a graph cached under another CPU capability builds when generated afresh
        try:
            with fresh_inductor(fresh):
                path, built = _record(run.parent / f"run-{fresh}", torch.compile(build_gate_net()), *args), True
            break
        except torch._dynamo.exc.BackendCompilerFailed:
            continue
    if path is None:  # no C++ compiler: step eager, keep the compile entry
        model = torch.compile(build_gate_net())
        path, built = _record(run.parent / "eager-stepped", model, *args, step_model=model._orig_mod), False
    replay = Replay(path, device="cpu")
    result = replay.run()
    return path, built, result, replay.try_fixes(result)


def test_the_compiled_snapshot_keeps_the_four_micro_batches_and_the_compile_entry(aot_nan):
    _, path, _, _ = aot_nan
    snap = torch.load(path, weights_only=True)
    assert path.name.endswith("nonfinite_loss.pt")
    assert len(snap["batch"]) == MICRO and snap["micro_batches"]["count"] == MICRO
    assert [(m["path"], m["backend"]) for m in snap["compile"]["modules"]] == [("", "aot_eager")]
    assert not any(k.startswith("_orig_mod") for k in snap["model_state"])


def test_eager_and_compiled_replays_rerun_every_micro_batch_and_name_micro_batch_2(aot_nan):
    _, _, _, r = aot_nan
    assert r.verdict == "nonfinite_input" and r.nonfinite_inputs == [f"batch:{BAD}.x"]
    assert r.culprit["micro_batch"] == BAD
    assert len(r.traces["float16"].micro_starts) == MICRO  # the eager run: four forwards and backwards
    cmp = r.compiled
    assert cmp["reproduced"] and cmp["backend"] == "aot_eager"
    assert cmp["micro_batches"] == MICRO and cmp["micro_batch"] == BAD  # finite after 0 and 1, NaN after 2
    assert not cmp["finite"] and "eager verdict stands" in cmp["note"]
    assert f"micro-batch {BAD} (0-based) of the {MICRO}" in r.summary
    from analyzer.render import render_replay_text

    line = next(x for x in render_replay_text(r).splitlines() if x.startswith("  compiled  "))
    assert line.endswith(f"; {MICRO} micro-batches, non-finite from micro-batch {BAD}")


def test_the_compiled_run_sums_the_micro_batch_losses_as_the_eager_run_does(aot_nan):
    """Without the NaN the two runs must agree: aot_eager keeps eager numerics, so the summed losses and
    gradients match; a compiled run of the first micro-batch alone would give another loss."""
    from analyzer.replay.compiled._run import compiled_once
    from analyzer.replay.runs._runs import run_once

    _, _, replay, _ = aot_nan
    ctx = replay.context()
    clean = [{k: torch.nan_to_num(v) for k, v in mb.items()} for mb in ctx.batch]
    saved, ctx.batch = ctx.batch, clean
    try:
        entries = replay.snapshot.compile["modules"]
        got = compiled_once(ctx, entries, "float32", 1.0)
        eager = run_once(ctx, "float32", 1.0)
        first = run_once(dataclasses.replace(ctx, micro=None, batch=clean[0]), "float32", 1.0)
    finally:
        ctx.batch = saved
    assert got.error is None and got.trace.finite and got.micro_batch is None
    assert got.trace.loss == pytest.approx(eager.loss, rel=1e-6)
    assert got.trace.grad_absmax == pytest.approx(eager.grad_absmax, rel=1e-6)
    assert first.loss != pytest.approx(eager.loss, rel=1e-3)


@pytest.mark.slow
def test_the_autopsy_of_the_compiled_accumulating_run_heads_with_micro_batch_2(aot_nan):
    from analyzer.autopsy import run_autopsy
    from analyzer.autopsy.answer import answer_lines

    run, *_ = aot_nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lines = answer_lines(run_autopsy(run, device="cpu"))
    assert lines[0].startswith("root cause: nonfinite_input: ")
    assert f"batch:{BAD}.x" in lines[0] and f"micro-batch {BAD} (0-based)" in lines[0]


def test_a_compiled_only_nan_in_micro_batch_2_names_gate_and_the_micro_batch_and_its_fix_is_verified(gate_accum):
    path, built, r, fixes = gate_accum
    assert r.runs["float32"]["finite"] and r.runs["float16"]["finite"]  # eager: every micro-batch finite
    if not built:  # no C++ compiler here: the eager verdict stands, marked
        assert r.compiled["reproduced"] is False and r.verdict == "healthy"
        assert r.compiled["note"].startswith("compiled step not reproduced: torch.compile could not build")
        return
    assert r.compiled["reproduced"], r.compiled["note"]  # training built the kernels here, so replay must too
    assert path.name.endswith("nonfinite_loss.pt")  # training's compiled step went NaN
    assert r.verdict == "compile_specific" and r.compiled["module"] == "gate"
    assert r.compiled["micro_batch"] == BAD and r.culprit["micro_batch"] == BAD
    assert r.culprit["module"] == "gate" and r.culprit["op"] == "<compiled>"
    assert f"micro-batch {BAD} (0-based) of the {MICRO}" in r.summary
    # gate excluded from compilation, all four micro-batches compiled again: the step comes out as FP32 eager's
    assert [(f.name, f.status) for f in fixes] == [("compile_disable", "verified")]

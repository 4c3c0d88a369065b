"""GradScaler's start-up calibration, then a real failure: the answer leads with the failure.

A real FP16 run (``gnll_models``): ``GradScaler("cpu")`` at its default 65536 skips steps 0-10
while it backs off to 32, then at step 22 the hand-written softplus's ``exp`` overflows with the
scale steady. The calibration spends no snapshot, the report names it calibration, and
``analyzer autopsy`` heads its answer with the step-22 overflow.
"""
from __future__ import annotations

import shutil

import polars as pl
import pytest
import torch

from analyzer.autopsy import run_autopsy
from recorders import Recorder, schema

from .gnll_models import FAIL_STEP, build_gnll, gnll_batches, gnll_loss

REF = "tests.analyzer.autopsy.gnll_models"
STEPS = FAIL_STEP + 2


def _train(run_dir, *, old_calibration_snapshot: bool = False):
    torch.manual_seed(0)
    model = build_gnll()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")  # the default init_scale, 65536
    with Recorder(run_dir, model, factory=f"{REF}:build_gnll", loss_fn=f"{REF}:gnll_loss", scaler=scaler,
                  amp_dtype=torch.float16, optimizer=opt) as rec:
        for step, batch in enumerate(gnll_batches(STEPS)):
            rec.begin_step(step, batch)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = gnll_loss(model, batch)
            scaler.scale(loss).backward()
            rec.end_step(loss)
            if old_calibration_snapshot and step == 7:
                # what recorders before the calibration rule wrote: a streak snapshot mid-calibration
                rec.snapshot("overflow_streak")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    return run_dir


@pytest.fixture(scope="module")
def gnll_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("gnll") / "run")


def test_the_recorder_spends_no_snapshot_on_eleven_start_up_backoffs(gnll_run):
    steps = pl.read_parquet(gnll_run / "trace" / schema.STEPS_GLOB).sort("step")
    skipped = steps["skipped"].to_list()
    assert skipped[:11] == [True] * 11 and not any(skipped[11:FAIL_STEP])  # 65536 -> 32 in 11 backoffs
    assert steps["scale"][11] == 32.0
    names = sorted(p.name for p in (gnll_run / schema.SNAPSHOT_DIR).glob(schema.SNAPSHOT_GLOB))
    assert names == [schema.snapshot_name(FAIL_STEP, 0, "nonfinite_loss")]


@pytest.mark.slow
def test_autopsy_heads_its_answer_with_the_later_failure_and_names_the_backoffs_calibration(gnll_run):
    a = run_autopsy(gnll_run)
    assert a.verdict == "overflow"
    c = a.culprit
    assert (c["op"], c["module"], c["phase"], a.primary.step) == ("aten.exp", "std", "forward", FAIL_STEP)
    answer = a.answer()
    assert answer[0].startswith("root cause: overflow: aten.exp in `std` (forward, float16)")
    assert f"step {FAIL_STEP}" in answer[1]
    assert any(line.startswith("untested advice: log(1 + exp(x)) is a hand-written softplus") for line in answer)
    [cal] = [f for f in a.report.findings if f.check == "startup_calibration"]
    assert (cal.severity, cal.step) == ("info", 0)
    assert cal.message.startswith("steps 0-10 were skipped while GradScaler backed off from 65536 to 32 in 11 "
                                  "backoffs before its first finite step: GradScaler's start-up calibration")
    assert [f.check for f in a.report.errors] == ["nonfinite_loss"]


@pytest.mark.slow
def test_a_calibration_streak_snapshot_of_an_older_recorder_is_not_replayed(tmp_path):
    run = _train(tmp_path / "run", old_calibration_snapshot=True)
    a = run_autopsy(run)
    assert [p["step"] for p in a.picked] == [FAIL_STEP]
    assert a.primary.step == FAIL_STEP and a.verdict == "overflow"
    assert not any("overflow_streak" in line for line in a.answer())

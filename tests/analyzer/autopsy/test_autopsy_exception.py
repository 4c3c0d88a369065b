"""Runs that died by an exception: ``analyzer report`` names it, ``analyzer autopsy`` replays its step.

The runs are real FP16 loops (``tests/exception_runs.py``) whose ``clip_grad_norm_(error_if_nonfinite=True)``
raises: at step 5 on a batch that overflows FP16 (GradScaler at 256), at step 0 on GradScaler's default
init_scale (65536, a loss-scale overflow), and at step 5 without a GradScaler.
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from analyzer.autopsy import run_autopsy
from analyzer.autopsy.pick import pick_snapshots
from analyzer.cli import main
from analyzer.report import build_report
from recorders import schema
from tests.exception_runs import CLIP_MESSAGE, CRASH_STEP, clip_loop


def _record(run_dir, **kwargs):
    with pytest.raises(RuntimeError, match=CLIP_MESSAGE):
        clip_loop(run_dir, **kwargs)
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("exc_runs")
    return {"scaled": _record(root / "scaled"), "step0": _record(root / "step0", init_scale=65536.0),
            "noscaler": _record(root / "noscaler", init_scale=None)}


@pytest.fixture(scope="module")
def autopsies(runs):
    return {name: run_autopsy(str(path), device="cpu") for name, path in runs.items()}


def _exception_finding(report):
    found = [f for f in report.findings if f.check == "exception"]
    assert len(found) == 1
    return found[0]


def test_the_report_has_an_exception_error_at_the_step_that_raised_with_its_message(runs):
    rep = build_report(runs["scaled"])
    f = _exception_finding(rep)
    assert f.severity == "error" and f.step == CRASH_STEP
    assert f.message.startswith(f"the loop raised at step {CRASH_STEP}: RuntimeError: The total norm")
    assert "exception_runs.py" in f.message and "clip_grad_norm_" in f.message  # the user's line
    assert rep.verdict.startswith("FAILED") and "exception" in rep.verdict
    assert f.evidence["type"] == "RuntimeError" and CLIP_MESSAGE in f.evidence["message"]
    assert f.evidence["snapshot"].endswith(schema.snapshot_name(CRASH_STEP, 0, "exception"))


def test_the_report_says_the_gradients_were_non_finite_first_and_that_grad_scaler_skips_such_steps(runs):
    f = _exception_finding(build_report(runs["scaled"]))
    assert f.evidence["grads_nonfinite"] is True and f.evidence["nonfinite_grads"] > 0
    # the loss never reached end_step; the gradients are the first non-finite values of the trace
    assert f.evidence["loss"] is None and f.evidence["first_nonfinite_grads_step"] == CRASH_STEP
    assert f.evidence["first_nonfinite_loss_step"] is None
    assert "its loss was not recorded" in f.message
    assert f"the first non-finite values the trace holds are the gradients at step {CRASH_STEP}" in f.message
    assert "a GradScaler skips exactly such a step" in f.message


def test_without_a_grad_scaler_the_report_does_not_claim_a_skip(runs):
    f = _exception_finding(build_report(runs["noscaler"]))
    assert "a GradScaler skips exactly such a step" not in f.message
    assert "without a GradScaler nothing else would have stopped this step" in f.message


def test_autopsy_picks_the_exception_snapshot_like_any_failing_one(runs):
    rep = build_report(runs["scaled"])
    picked = pick_snapshots(rep.frames.snapshots)
    assert [(p["step"], p["reason"]) for p in picked] == [(CRASH_STEP, "exception")]


def test_autopsy_replays_the_step_to_an_fp16_overflow_with_the_culprit_named(autopsies):
    a = autopsies["scaled"]
    assert a.verdict == "overflow" and a.primary.step == CRASH_STEP
    assert (a.culprit["op"], a.culprit["module"], a.culprit["phase"]) == ("aten.addmm", "0", "forward")
    # the replay says what the step does in FP32 and in FP16
    assert a.primary.runs["float32"]["finite"] is True and a.primary.runs["float16"]["finite"] is False
    assert a.primary.exception["type"] == "RuntimeError"


def _skip(a):
    fixes = [f for _, f in a.fixes if f.name == "scaler_skip"]
    assert len(fixes) == 1
    return fixes[0]


def test_autopsy_verifies_the_grad_scaler_skip_fix_on_the_step(autopsies):
    fix = _skip(autopsies["scaled"])
    assert fix.status == "verified" and fix.precision == "float16"
    assert "error_if_nonfinite=False" in fix.title and "scaler.unscale_(optimizer)" in fix.title
    # what was checked, in the printed line: FP16's scaled gradients non-finite, FP32 finite, a real
    # GradScaler skipped the step, the weights kept bit for bit, the scale backed off 256 -> 128
    assert f"checked on step {CRASH_STEP}: float16 at loss scale 256 has non-finite gradients" in fix.detail
    assert "FP32 is finite" in fix.detail
    assert "all 4 parameters kept their pre-step values bit for bit, the scale backed off to 128" in fix.detail
    answer = autopsies["scaled"].answer()
    assert any(line.startswith("raised: RuntimeError: The total norm") for line in answer)
    assert any(line.startswith("verified fix: let GradScaler skip the step") for line in answer)


def test_a_step_0_crash_at_the_default_init_scale_is_a_loss_scale_overflow_grad_scaler_skips(autopsies):
    a = autopsies["step0"]
    assert a.verdict == "loss_scale_overflow" and a.primary.step == 0 and a.primary.scale == 65536.0
    assert a.culprit["phase"] == "backward" and a.culprit["module"] == "1"
    fix = _skip(a)
    assert fix.status == "verified" and "the scale backed off to 32768" in fix.detail
    assert "(the backward overflowed)" in fix.detail


def test_without_a_grad_scaler_the_skip_fix_is_not_tried_and_says_why(autopsies):
    a = autopsies["noscaler"]
    assert a.verdict == "overflow"
    fix = _skip(a)
    assert fix.status == "not_tried" and "the run has no GradScaler" in fix.detail
    assert "call optimizer.step() only when torch.isfinite(norm)" in fix.detail
    assert not any("let GradScaler skip" in adv.text for _, adv in a.advice)  # never worded as a recommendation


def test_the_autopsy_cli_prints_the_exception_and_the_verified_skip_and_its_json_carries_them(runs):
    res = CliRunner().invoke(main, ["autopsy", str(runs["scaled"]), "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["verdict"] == "overflow"
    assert out["replays"][0]["exception"]["type"] == "RuntimeError"
    assert [f["status"] for f in out["fixes"] if f["name"] == "scaler_skip"] == ["verified"]
    assert any(f["check"] == "exception" and f["step"] == CRASH_STEP for f in out["report"]["findings"])


def _meta_only_run(run_dir, exc: BaseException):
    import torch

    from recorders import Recorder
    from tests.recorders.models import build_mlp, mse_loss

    model = build_mlp()
    with pytest.raises(type(exc)):
        with Recorder(run_dir, model, factory="tests.recorders.models:build_mlp",
                      loss_fn="tests.recorders.models:mse_loss") as rec:
            for step in range(3):
                batch = {"x": torch.randn(4, 8), "y": torch.randn(4, 1)}
                rec.begin_step(step, batch)
                loss = mse_loss(model, batch)
                loss.backward()
                rec.end_step(loss)
                if step == 1:
                    raise exc  # after end_step: no step is open
    return run_dir


def test_an_exception_between_steps_is_an_error_dated_at_the_last_step_with_nothing_to_replay(tmp_path):
    rep = build_report(_meta_only_run(tmp_path / "run", OSError("the data loader's worker died")))
    f = _exception_finding(rep)
    assert f.severity == "error" and f.step == 1 and f.evidence["step"] is None
    assert f.message.startswith("the loop raised after step 1 had ended")
    assert "OSError: the data loader's worker died" in f.message and "no step was open" in f.message


def test_a_keyboard_interrupt_is_reported_as_info_not_as_a_failure(tmp_path):
    rep = build_report(_meta_only_run(tmp_path / "run", KeyboardInterrupt()))
    f = _exception_finding(rep)
    assert f.severity == "info" and f.message.startswith("the run was interrupted outside any step: KeyboardInterrupt")
    assert not rep.errors


def test_a_damaged_exception_entry_in_meta_json_does_not_break_the_report(tmp_path):
    run_dir = _meta_only_run(tmp_path / "run", ValueError("x"))
    meta = json.loads((run_dir / "meta.json").read_text())
    meta["exception"] = {"type": ["not", "a", "string"], "message": 3}
    (run_dir / "meta.json").write_text(json.dumps(meta))
    rep = build_report(run_dir)
    assert [f for f in rep.findings if f.check in ("exception", "check_failed")] == []

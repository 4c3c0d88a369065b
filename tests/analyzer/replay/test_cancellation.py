"""A hand-written batch norm with the one-pass variance E[h²] − E[h]², in BF16 (``cancel_models``):
the verdict names the cancelling subtraction, the clamp that hides it changes the step's result,
and keeping the module in FP32 is verified against the FP32 run's loss (plain loop and Lightning)."""
from __future__ import annotations

import json

import pytest

from analyzer.autopsy.autopsy import run_autopsy
from analyzer.replay import Replay, advice_with_status
from analyzer.replay.fixes._reference import TOLERANCE
from tests.analyzer.replay import cancel_models as cm
from tests.extras import require


def _replayed(snapshot):
    replay = Replay(snapshot, device="cpu")
    result = replay.run()
    fixes = replay.try_fixes(result)
    return result, {f.name: f for f in fixes}, advice_with_status(result, fixes)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _replayed(cm.train(tmp_path_factory.mktemp("onepass") / "run"))


@pytest.fixture(scope="module")
def lightning(tmp_path_factory):
    require("lightning", "lightning")
    from tests.analyzer.replay import cancel_lightning

    return _replayed(cancel_lightning.fit(tmp_path_factory.mktemp("onepass_lightning") / "run"))


@pytest.fixture(params=["plain", "lightning"])
def case(request):
    return request.getfixturevalue(request.param)


def test_the_verdict_is_cancellation_at_the_sqrt_of_norm_and_names_the_cancelling_sub(case):
    result, _, _ = case
    assert result.verdict == "cancellation"  # FP32 is finite: not numerical_bug
    c = result.culprit
    norm = c["module"]  # `norm`; `model.norm` in the LightningModule, which holds the Regressor as `model`
    assert (c["op"], norm.rpartition(".")[2], c["precision"]) == ("aten.sqrt", "norm", "bfloat16")
    k = c["cancelled_at"]
    # var = (h * h).mean(0) - m * m: terms near 4e4 (BF16 spacing 256) whose difference is a few units
    assert (k["op"], k["module"], k["pattern"]) == ("aten.sub", norm, "one_pass_variance")
    ex = k["example"]
    assert ex["result"] < 0 and ex["a"] > 1e4 and ex["b"] > 1e4 and ex["a"] - ex["b"] == ex["result"]
    assert k["fp32_output_absmax"] < 100  # the same op in the FP32 run: the true variances, a few units
    assert f"aten.sub in `{norm}`" in result.summary and f"= {ex['result']:.3g}" in result.summary
    assert "though the FP32 run stayed finite" not in result.summary
    assert any("torch.var" in a for a in result.advice)


def test_the_clamp_guard_changes_the_result_shows_both_losses_and_is_not_recommended(case):
    result, fixes, advice = case
    clamp = fixes["guard_clamp"]
    fp32 = result.runs["float32"]["loss"]
    assert clamp.status == "changes_result"
    assert clamp.reference_loss == fp32 and clamp.loss > 1e6 * fp32  # sqrt(tiny) ~ 1e-19 in the denominator
    assert f"{clamp.loss:.4g}" in clamp.detail and f"{fp32:.4g}" in clamp.detail
    assert all(a.fix != "guard_clamp" for a in advice)
    assert not any("clamp_min" in a.text for a in advice if a.status == "verified")


def test_keeping_norm_in_fp32_is_verified_with_its_loss_within_tolerance_of_fp32(case):
    result, fixes, advice = case
    fix = fixes["module_fp32"]
    fp32 = result.runs["float32"]["loss"]
    assert fix.status == "verified" and fix.precision == "bfloat16"
    assert abs(fix.loss - fp32) <= TOLERANCE["bfloat16"] * abs(fp32) and fix.reference_loss == fp32
    assert f"{fix.loss:.4g}" in fix.detail and f"{fp32:.4g}" in fix.detail
    line = next(a for a in advice if a.fix == "module_fp32")
    assert line.status == "verified" and f"{fix.loss:.4g}" in line.text and f"{fp32:.4g}" in line.text
    assert advice[0].fix == "module_fp32"  # the first "do" line is the fix that matches FP32


def test_the_json_carries_the_cancelling_op_and_both_losses_of_each_fix(plain):
    result, fixes, _ = plain
    obj = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert obj["verdict"] == "cancellation" and obj["culprit"]["cancelled_at"]["op"] == "aten.sub"
    clamp = json.loads(json.dumps(fixes["guard_clamp"].to_dict(), allow_nan=False))
    assert clamp["status"] == "changes_result" and clamp["loss"] > clamp["reference_loss"] > 0


def test_the_autopsy_answer_does_the_fp32_module_and_lists_the_clamp_as_changing_the_result(tmp_path):
    snap = cm.train(tmp_path / "run")
    lines = run_autopsy(snap.parent.parent, device="cpu").answer()
    assert lines[0].startswith("root cause: cancellation: aten.sqrt in `norm`")
    assert any(line.startswith("tried, changes the result: guard sqrt") for line in lines)
    do = [line for line in lines if line.startswith("do (verified above): ")]
    assert do and do[0].startswith("do (verified above): Keep `norm` in FP32")
    assert not any("clamp_min" in line for line in do)

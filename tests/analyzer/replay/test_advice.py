"""Advice with a status (``advice_with_status``) and replay's own advice: a fix that failed is never recommended.

Every case is a real recorded step, replayed, with its fixes really tried.
"""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.replay import Advice, Diagnosis, advice_with_status, replay_snapshot, try_fixes
from analyzer.replay.verdicts import registry as verdicts

from . import fix_models as fm


def _recommends_bf16(text: str) -> bool:
    """A printed line that mentions BF16 at all (a broad guard for lines that must be absent)."""
    return "BF16" in text or "bfloat16" in text


def _bf16_lines(r) -> list[str]:
    """The replay's own advice lines that recommend the ``bf16`` fix, selected by the fix they name."""
    return [a.text for a in r.advice_lines if "bf16" in a.fixes]


@pytest.fixture(scope="module")
def bce_snapshot(bce_step):
    return bce_step  # the hand-written BCE (tests/analyzer/conftest.py)


@pytest.fixture(scope="module")
def bce_advice(bce_snapshot):
    r = replay_snapshot(bce_snapshot)
    return r, advice_with_status(r, try_fixes(bce_snapshot, r))


def test_the_bce_step_gets_no_advice_to_switch_to_bf16(bce_advice):
    _, advice = bce_advice
    assert advice and all(isinstance(a, Advice) for a in advice)
    assert not [a.text for a in advice if _recommends_bf16(a.text)]
    assert all(a.fix != "bf16" for a in advice)


def test_the_bce_step_gets_the_logsigmoid_and_bce_with_logits_advice_marked_untested(bce_advice):
    _, advice = bce_advice
    found = [a for a in advice if "logsigmoid" in a.text and "binary_cross_entropy_with_logits" in a.text]
    assert len(found) == 1 and found[0].status == "untested" and found[0].fix is None


def test_the_clamp_that_changes_the_result_is_not_advised_and_the_bce_pattern_comes_first(bce_advice):
    # the clamp makes the step finite, 3% off FP32's loss with the wrong sample's gradient lost
    # (test_fixes.py): changes_result, so no line rests on it and nothing is marked verified
    _, advice = bce_advice
    assert all(a.fix not in ("guard_clamp", "guard_eps") and a.status == "untested" for a in advice)
    assert "binary_cross_entropy_with_logits" in advice[0].text
    for a in advice:
        obj = a.to_dict()
        assert json.loads(json.dumps(obj, allow_nan=False)) == obj


def test_replay_runs_bf16_itself_when_its_advice_names_it_so_the_line_is_never_untested(bce_advice):
    r, advice = bce_advice
    assert "bfloat16" in r.runs  # no --dtypes asked for it: the underflow advice names BF16
    assert not [a for a in r.advice if "untested" in a]
    assert not [a.text for a in advice if _recommends_bf16(a.text) and a.status == "untested"]
    # this step's BF16 replay is non-finite as well, so switching to BF16 is not advised at all
    assert not r.runs["bfloat16"]["finite"] and not _bf16_lines(r) and not [a for a in r.advice if _recommends_bf16(a)]


def test_replay_drops_switch_to_bf16_when_the_bf16_replay_is_non_finite(bce_snapshot):
    r = replay_snapshot(bce_snapshot, dtypes=["bf16"])
    assert not r.runs["bfloat16"]["finite"]
    assert not _bf16_lines(r) and not [a for a in r.advice if _recommends_bf16(a)]


@pytest.fixture(scope="module")
def attention(fp16_attention_step):
    return fp16_attention_step  # unscaled FP16 attention logits past 65504 (tests/analyzer/conftest.py)


def test_replay_keeps_switch_to_bf16_unmarked_when_the_bf16_replay_is_finite(attention):
    r = replay_snapshot(attention, dtypes=["bf16"])
    assert r.verdict == "overflow" and r.runs["bfloat16"]["finite"]
    line, = _bf16_lines(r)
    assert "untested" not in line


def test_verified_fixes_of_an_overflow_are_advice_and_the_failed_op_fix_is_not(attention):
    r = replay_snapshot(attention)
    fixes = try_fixes(attention, r)
    status = {f.name: f.status for f in fixes}
    advice = advice_with_status(r, fixes)
    verified = [a.fix for a in advice if a.status == "verified"]
    assert verified == [f.name for f in fixes if f.status == "verified"]
    assert {"module_fp32", "bf16"} <= set(verified)
    assert status["op_fp32"] == "fails" and "op_fp32" not in {a.fix for a in advice}
    # the sqrt(d) advice cannot be tried on the snapshot: it is printed, untested
    assert any("sqrt" in a.text and a.status == "untested" for a in advice)


def test_a_hand_written_log_of_softmax_gets_the_log_softmax_advice(log_zero_step):
    # logits (200, 0, -200): p(class 2) = exp(-400) is 0 even in FP32; the loss takes log(softmax(x))[y]
    snap = log_zero_step
    r = replay_snapshot(snap)
    advice = advice_with_status(r, try_fixes(snap, r))
    found = [a for a in advice if a.text.startswith("log(softmax(x))")]
    assert len(found) == 1 and found[0].status == "untested" and "log_softmax" in found[0].text


def test_a_sqrt_of_a_sum_of_squares_at_zero_gets_the_vector_norm_advice(zero_row_norm_step):
    snap = zero_row_norm_step
    r = replay_snapshot(snap)
    advice = advice_with_status(r, try_fixes(snap, r))
    assert any("torch.linalg.vector_norm" in a.text and a.status == "untested" for a in advice)


def test_a_healthy_step_keeps_its_one_untested_note(healthy_mlp_step):
    snap = healthy_mlp_step
    r = replay_snapshot(snap)
    advice = advice_with_status(r, try_fixes(snap, r))
    assert [a.status for a in advice] == ["untested"] and advice[0].text == r.advice[0]


def test_advice_with_an_unknown_status_is_refused():
    with pytest.raises(ValueError, match="status"):
        Advice(text="t", status="fails")


def test_a_float32_min_mask_cast_to_fp16_gets_the_finite_fill_advice_and_no_bf16(tmp_path):
    snap = fm.record(tmp_path, factory="build_masked_scores", loss_fn="masked_scores_loss", batch=fm.masked_batch(),
                     amp_dtype=torch.float16)
    r = replay_snapshot(snap)
    assert (r.verdict, r.culprit["op"]) == ("overflow", "aten._to_copy")  # finfo(float32).min -> -inf in FP16
    fixes = {f.name: f for f in try_fixes(snap, r)}
    assert fixes["bf16"].status == "fails"  # float32's min is past BF16's max too
    advice = advice_with_status(r, list(fixes.values()))
    fill = [a for a in advice if a.text.startswith("A mask filled with torch.finfo(dtype).min")]
    assert len(fill) == 1 and fill[0].status == "untested"
    assert not [a.text for a in advice if _recommends_bf16(a.text)]


@pytest.mark.parametrize("verdict", ["overflow", "underflow", "loss_scale_overflow", "numerical_bug"])
@given(tried=st.dictionaries(st.sampled_from(["float32", "float16", "bfloat16"]), st.booleans()))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_replay_advice_names_bf16_only_as_its_bf16_run_allows(bce_advice, verdict, tried):
    r, _ = bce_advice  # a real culprit; the verdict picks which advice lines are written
    lines = verdicts.advice(Diagnosis(verdict, r.culprit, scale=65536.0, tried=tried))
    bf16 = [a.text for a in lines if "bf16" in a.fixes]
    if verdict != "numerical_bug" and tried.get("bfloat16") is not False:
        assert bf16  # overflow and underflow advise BF16 for an FP16 culprit: the selection is not empty
    if tried.get("bfloat16") is False:
        assert bf16 == []
    elif "bfloat16" not in tried:
        assert all(a.endswith("(untested)") for a in bf16)
    else:
        assert not any("untested" in a for a in bf16)

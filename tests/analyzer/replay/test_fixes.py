"""Fixes tried on the snapshot (``analyzer.replay.fixes.registry``): real recorded steps, real replays, real fix runs."""
from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from analyzer.replay import FIX_STATUSES, Fix, Replay, replay_snapshot, try_fixes
from analyzer.replay.runs._runs import run_once

from . import fix_models as fm
from . import replay_models as rm


def _by_name(fixes: list[Fix]) -> dict[str, Fix]:
    names = [f.name for f in fixes]
    assert len(names) == len(set(names)), names  # each fix is tried at most once
    return {f.name: f for f in fixes}


def _strict(fixes: list[Fix]) -> None:
    for f in fixes:
        assert f.status in FIX_STATUSES
        obj = f.to_dict()
        assert json.loads(json.dumps(obj, allow_nan=False)) == obj


@pytest.fixture(scope="module")
def bce(bce_step):
    """The hand-written BCE: one FP16 step, logit 10 and label 0 (tests/analyzer/conftest.py)."""
    result = replay_snapshot(bce_step)
    return bce_step, result, try_fixes(bce_step, result)


def test_a_hand_written_bce_in_fp16_underflows_at_log_fed_by_one_minus_p(bce):
    _, r, _ = bce
    assert (r.verdict, r.culprit["op"], r.culprit["module"]) == ("underflow", "aten.log", "<loss_fn>")
    assert r.underflow_at["op"] == "aten.rsub"  # 1 - p is where the FP32 non-zero became 0


def test_bf16_fails_on_the_bce_step_because_it_rounds_sigmoid_to_one_as_well(bce):
    _, _, fixes = bce
    _strict(fixes)
    bf16 = _by_name(fixes)["bf16"]
    assert bf16.status == "fails" and bf16.precision == "bfloat16"
    assert bf16.failing_op == "aten.log in <loss_fn> (forward)"


def test_clamping_the_log_input_makes_the_bce_step_finite_but_not_as_fp32_computes_it(bce):
    # 1 - p = 0 clamped to FP16's tiny (6.1e-5) gives log = -9.7 where FP32 has -10.00005, and the clamp
    # passes no gradient: the wrong sample's gradient is lost (largest |gradient| 0.13 against FP32's 0.63),
    # the loss is 5.01 against 5.16, 3% off. Finite is not verified: the fix changes the step's result.
    _, r, fixes = bce
    clamp = _by_name(fixes)["guard_clamp"]
    assert clamp.status == "changes_result" and clamp.precision == "float16"
    assert "fix_models.py:" in clamp.title and "clamp_min" in clamp.title
    assert clamp.reference_loss == r.runs["float32"]["loss"] and abs(clamp.loss / clamp.reference_loss - 1) > 0.01
    assert "largest |gradient|" in clamp.detail


def test_the_module_fix_is_not_tried_when_the_culprit_is_in_the_loss_function(bce):
    _, _, fixes = bce
    module = _by_name(fixes)["module_fp32"]
    assert module.status == "not_tried" and "loss function" in module.detail


def test_the_op_alone_in_fp32_fails_when_its_input_is_already_zero(bce):
    # log(0) is -inf in FP32 too: the zero was made upstream, by 1 - p
    _, _, fixes = bce
    op = _by_name(fixes)["op_fp32"]
    assert op.status == "fails" and op.failing_op.startswith("aten.log")


def test_a_fix_run_replays_the_culprits_precision_and_leaves_the_replay_result_unchanged(bce):
    snap, r, fixes = bce
    before = r.to_dict()
    again = try_fixes(snap, r)
    assert [(f.name, f.status) for f in again] == [(f.name, f.status) for f in fixes]
    assert r.to_dict() == before


def test_lower_scale_finds_a_power_of_two_whose_backward_is_finite(scaled_sum_mse_step):
    # sum-reduced MSE with |out - y| ~ 3 at scale 65536: the scaled backward does not fit FP16
    snap = scaled_sum_mse_step
    replay = Replay(snap)
    r = replay.run()
    assert r.verdict == "loss_scale_overflow"
    fixes = replay.try_fixes(r)
    _strict(fixes)
    low = _by_name(fixes)["lower_scale"]
    assert low.status == "verified"
    s = low.max_safe_scale
    assert s is not None and 1.0 <= s < 65536.0 and math.log2(s) == int(math.log2(s))
    # checked independently: the step at that scale has a finite FP16 backward, at 65536 it has not
    ctx = replay.context()
    assert run_once(ctx, "float16", s).finite and not run_once(ctx, "float16", 65536.0).grads_finite


def test_a_nonfinite_batch_gets_one_untried_fix_naming_it(tmp_path):
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    x[1, 2] = float("nan")
    snap = rm.record_step(tmp_path, factory="build_mlp", loss_fn="mse", batch={"x": x, "y": torch.randn(4, 1)},
                          amp_dtype=torch.float16)
    r = replay_snapshot(snap)
    assert r.verdict == "nonfinite_input"
    fixes = try_fixes(snap, r)
    _strict(fixes)
    assert [(f.name, f.status) for f in fixes] == [("check_input", "not_tried")]
    assert "batch entry x" in fixes[0].title and "data pipeline" in fixes[0].detail


def test_a_healthy_step_has_no_fixes(healthy_mlp_step):
    snap = healthy_mlp_step
    r = replay_snapshot(snap)
    assert r.verdict == "healthy" and try_fixes(snap, r) == []


def test_a_log_of_zero_in_fp32_is_fixed_by_the_clamp_and_not_by_any_precision(log_zero_step):
    # logits (200, 0, -200): p(class 2) = exp(-400) is exactly 0 in FP32 too
    snap = log_zero_step
    r = replay_snapshot(snap)
    assert (r.verdict, r.culprit["precision"]) == ("numerical_bug", "float32")
    fixes = _by_name(try_fixes(snap, r))
    assert fixes["guard_clamp"].status == "verified" and fixes["guard_clamp"].precision == "float32"
    assert fixes["bf16"].status == "not_tried" and "FP32 replay is non-finite" in fixes["bf16"].detail
    assert "module_fp32" not in fixes and "op_fp32" not in fixes  # FP32 already: nothing to upcast


def test_a_sqrt_at_zero_that_fails_in_backward_is_guarded_at_its_forward_line(zero_row_norm_step):
    snap = zero_row_norm_step  # a zero row: sqrt'(0) is infinite in backward
    r = replay_snapshot(snap)
    assert (r.verdict, r.culprit["phase"], r.culprit["node"]) == ("numerical_bug", "backward", "SqrtBackward0")
    fixes = _by_name(try_fixes(snap, r))
    assert fixes["guard_clamp"].status == "verified" and fixes["guard_eps"].status == "verified"
    assert "replay_models.py:" in fixes["guard_clamp"].title


def test_keeping_the_attention_module_in_fp32_fixes_a_tiny_fp16_overflow(fp16_attention_step):
    snap = fp16_attention_step
    r = replay_snapshot(snap)
    assert (r.verdict, r.culprit["module"]) == ("overflow", "attn")
    fixes = _by_name(try_fixes(snap, r))
    assert fixes["module_fp32"].status == "verified"
    assert fixes["bf16"].status == "verified"
    # q @ k^T itself exceeds 65504: computing it in FP32 and casting back still gives inf
    assert fixes["op_fp32"].status == "fails" and fixes["op_fp32"].failing_op.startswith("aten.")


@pytest.mark.slow
def test_the_attention_sample_is_fixed_by_fp32_attention_and_by_bf16(tmp_path_factory):
    from samples._common import snapshots_of
    from tests.sample_runs import sample_run

    snap = snapshots_of(sample_run(tmp_path_factory, "fp16_attention_overflow"))[0]
    r = replay_snapshot(snap)
    fixes = _by_name(try_fixes(snap, r))
    assert fixes["module_fp32"].status == "verified" and "blocks.0.attn" in fixes["module_fp32"].title
    # every attention module of the GPT: with blocks.0.attn alone in FP32, blocks.1.attn overflows next
    assert "blocks.1.attn" in fixes["module_fp32"].title
    assert fixes["bf16"].status == "verified"


@given(name=st.text(max_size=20), status=st.sampled_from(FIX_STATUSES),
       scale=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)))
def test_a_fix_serialises_to_strict_json_whatever_it_holds(name, status, scale):
    obj = Fix(name=name, title=name, status=status, detail="d", max_safe_scale=scale).to_dict()
    assert json.loads(json.dumps(obj, allow_nan=False)) == obj


def test_a_fix_with_an_unknown_status_is_refused():
    with pytest.raises(ValueError, match="status"):
        Fix(name="bf16", title="t", status="works", detail="d")


def test_an_unregistered_op_whose_intermediate_overflows_is_fixed_by_running_it_alone_in_fp32(tmp_path):
    # softplus(20) = log1p(exp(20)): exp(20) = 4.9e8 is inf in FP16, the result 20 fits
    batch = {"x": torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]), "y": torch.zeros(2, 1)}
    snap = fm.record(tmp_path, factory="build_softplus_net", loss_fn="mse", batch=batch, amp_dtype=torch.float16)
    r = replay_snapshot(snap)
    assert (r.verdict, r.culprit["op"]) == ("unregistered_op", "ampautopsy_fixtests.softplus")
    fixes = _by_name(try_fixes(snap, r))
    assert fixes["op_fp32"].status == "verified" and fixes["op_fp32"].precision == "float16"
    assert fixes["module_fp32"].status == "verified" and "1" in fixes["module_fp32"].title


def test_a_backward_overflow_at_scale_one_gets_a_safe_scale_below_one(tmp_path):
    # sum-reduced MSE against targets of 1e5: d loss / d out ~ 2e5 does not fit FP16 even unscaled
    batch = {"x": torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), "y": torch.full((4, 1), 1e5)}
    snap = rm.record_step(tmp_path, factory="build_mlp", loss_fn="sum_mse", batch=batch, amp_dtype=torch.float16,
                          init_scale=1.0, overflow_streak=1)
    replay = Replay(snap)
    r = replay.run()
    assert (r.verdict, r.culprit["phase"], r.scale) == ("overflow", "backward", 1.0)
    fixes = _by_name(replay.try_fixes(r))
    low = fixes["lower_scale"]
    assert low.status == "verified"
    s = low.max_safe_scale
    assert s < 1.0 and math.log2(s) == int(math.log2(s))
    assert run_once(replay.context(), "float16", s).finite

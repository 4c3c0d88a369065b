"""End to end: one real recorded failure per verdict, replayed and classified.

Every snapshot here is written by the real ``Recorder`` around one real training step of a tiny
CPU model (see ``replay_models.py``); nothing is mocked.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from analyzer.replay import VERDICTS, replay_snapshot
from recorders.snapshot import build_snapshot, write_snapshot

from . import replay_models as rm

T, D = 8, 8


def _line_of(code: str) -> str:
    """``replay_models.py:N`` of the line holding `code`, so the pins survive edits above it."""
    lines = Path(rm.__file__).read_text().splitlines()
    return f"replay_models.py:{next(i for i, line in enumerate(lines, 1) if code in line)}"


def _strict_json(result) -> None:
    """Every result serialises to strict JSON (no NaN/Infinity literals) with a known verdict."""
    obj = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert obj["verdict"] in VERDICTS and isinstance(obj["advice"], list)


def _gen():
    return torch.Generator().manual_seed(0)


@pytest.fixture(scope="module")
def attention_overflow(fp16_attention_replay):
    # gain 8: logits = 64 <x, x'> with |x| ~ 10*sqrt(8) gives ~1e5 on the diagonal: > 65504.
    # The step (d = 8, T = 8) is shared with other test files: tests/analyzer/conftest.py.
    return fp16_attention_replay


def test_unscaled_attention_logits_overflow_in_fp16_in_the_attention_module_forward(attention_overflow):
    r = attention_overflow
    assert r.verdict == "overflow"
    c = r.culprit
    assert (c["op"], c["module"], c["phase"], c["precision"]) == ("aten.bmm", "attn", "forward", "float16")
    assert c["source"].endswith(_line_of("logits = q @ k.transpose(-2, -1)"))
    # the same inputs in FP32 give the real logit, above FP16's max: that is what overflow means
    assert c["shadow"]["float32"] > 65504 and math.isfinite(c["shadow"]["float32"])
    assert c["shadow"]["dtype_max"] == 65504.0
    assert c["output_absmax"] == math.inf and c["input_absmax"] < 65504


def test_the_overflowing_attention_step_is_finite_in_bf16_and_fp32(attention_overflow):
    runs = attention_overflow.runs
    assert runs["float32"]["finite"] and runs["bfloat16"]["finite"]
    assert not runs["float16"]["finite"] and not runs["float16"]["forward_finite"]
    assert runs["float16"]["first_nonfinite"]["op"] == "aten.bmm"


def test_overflow_advice_says_to_scale_logits_switch_to_bf16_and_keep_the_module_in_fp32(attention_overflow):
    text = " ".join(attention_overflow.advice)
    assert "sqrt(head_dim)" in text and "BF16" in text and "Keep `attn` in FP32" in text
    # head_dim 8 (build_attention(d=8)): the FP32 logit over sqrt(8) is under FP16's max, so the line offers it
    logit = attention_overflow.culprit["shadow"]["float32"]
    line = next(a for a in attention_overflow.advice if a.startswith("Divide the attention logits"))
    assert f"sqrt(head_dim) = {math.sqrt(8):.3g}" in line and logit / math.sqrt(8) < 65504
    assert f"{logit:.3g} in FP32, becomes {logit / math.sqrt(8):.3g}, under float16's max 65504" in line


def test_log_of_a_zero_probability_is_a_numerical_bug_at_aten_log(log_zero_step):
    # logits (200, 0, -200): p(class 2) = exp(-400) is exactly 0 in FP32 too.
    r = replay_snapshot(log_zero_step)
    _strict_json(r)
    assert r.verdict == "numerical_bug"
    assert (r.culprit["op"], r.culprit["phase"], r.culprit["precision"]) == ("aten.log", "forward", "float32")
    assert r.culprit["module"] == "<loss_fn>"  # the log is in the loss function, outside any module
    assert r.culprit["shadow"]["float64"] == math.inf  # log(0) is -inf in FP64 as well
    assert any("log_softmax" in a for a in r.advice)


def test_sqrt_at_zero_is_a_backward_numerical_bug_in_the_norm_module(tmp_path):
    x = torch.randn(4, 4, generator=_gen())
    x[0] = 0  # the projection of a zero row is zero, and sqrt'(0) is infinite
    path = rm.record_step(tmp_path, factory="build_norm", loss_fn="mean_loss", batch={"x": x},
                          amp_dtype=torch.float16)
    r = replay_snapshot(path)
    _strict_json(r)
    assert r.verdict == "numerical_bug"
    c = r.culprit
    assert (c["phase"], c["module"], c["node"]) == ("backward", "norm", "SqrtBackward0")
    assert c["source"].endswith(_line_of("return torch.sqrt("))  # the forward line that called sqrt
    assert r.runs["float32"]["forward_finite"] and not r.runs["float32"]["backward_finite"]
    assert any("inside the sqrt" in a for a in r.advice)


def test_a_fully_masked_softmax_row_is_a_numerical_bug_at_softmax_fed_by_the_mask_value(tmp_path):
    g = _gen()
    mask = torch.ones(2, T, T, dtype=torch.bool)
    mask[0, 3, :] = False  # query 3 of sample 0 may attend to nothing
    batch = {"x": torch.randn(2, T, D, generator=g), "y": torch.randn(2, T, 1, generator=g), "mask": mask}
    path = rm.record_step(tmp_path, factory="build_attention", loss_fn="attention_mse",
                          factory_kwargs={"d": D, "scaled": True}, batch=batch, amp_dtype=torch.bfloat16)
    r = replay_snapshot(path)
    _strict_json(r)
    assert r.verdict == "numerical_bug"
    assert (r.culprit["op"], r.culprit["module"]) == ("aten._softmax", "attn")
    assert r.literal_nonfinite["op"] == "aten.masked_fill"  # the -inf written on purpose
    assert any("finite mask value" in a for a in r.advice)


def test_a_nan_weight_is_a_nonfinite_input_naming_the_parameter(tmp_path):
    def poison(model):
        with torch.no_grad():
            model[2].weight[0, 3] = float("nan")  # fault injected before the recorded step

    g = _gen()
    batch = {"x": torch.randn(4, 4, generator=g), "y": torch.randn(4, 1, generator=g)}
    path = rm.record_step(tmp_path, factory="build_mlp", loss_fn="mse", batch=batch,
                          amp_dtype=torch.float16, inject=poison)
    r = replay_snapshot(path)
    _strict_json(r)
    assert r.verdict == "nonfinite_input"
    assert r.nonfinite_inputs == ["param:2.weight"]
    assert r.culprit["input"] == "param:2.weight" and r.culprit["module"] == "2"
    assert "param:2.weight" in r.summary


def test_a_nan_in_the_batch_is_a_nonfinite_input_naming_its_path(tmp_path):
    g = _gen()
    x = torch.randn(4, 4, generator=g)
    x[1, 2] = float("nan")
    path = rm.record_step(tmp_path, factory="build_mlp", loss_fn="mse",
                          batch={"x": x, "y": torch.randn(4, 1, generator=g)}, amp_dtype=torch.float16)
    r = replay_snapshot(path)
    _strict_json(r)
    assert r.verdict == "nonfinite_input"
    assert r.nonfinite_inputs == ["batch:x"]
    assert any("data pipeline" in a for a in r.advice)


def test_an_eps_of_1e_12_flushes_to_zero_in_fp16_and_is_an_underflow(tmp_path):
    g = _gen()
    x = torch.randn(4, 4, generator=g)
    x[0] = 0  # a zero row: variance 0, so rsqrt(var + eps) needs eps, which FP16 rounds to 0
    path = rm.record_step(tmp_path, factory="build_eps_net", loss_fn="mse",
                          batch={"x": x, "y": torch.randn(4, 1, generator=g)}, amp_dtype=torch.float16)
    r = replay_snapshot(path)
    _strict_json(r)
    assert r.verdict == "underflow"
    assert (r.culprit["op"], r.culprit["module"], r.culprit["precision"]) == ("aten.rsqrt", "1", "float16")
    # the zeros appear at `var + eps`: 1 zero (the zero row's variance) in FP16, none in FP32
    assert r.underflow_at["op"] == "aten.add"
    assert (r.underflow_at["zeros"], r.underflow_at["fp32_zeros"]) == (1, 0)
    assert r.culprit["fp32_output_absmax"] == pytest.approx(1e6, rel=1e-3)  # rsqrt(1e-12) in the FP32 run
    assert r.runs["float32"]["finite"]


def test_a_custom_op_fed_fp16_by_autocast_is_an_unregistered_op(tmp_path):
    g = _gen()
    batch = {"x": torch.randn(4, 4, generator=g) * 3, "y": torch.randn(4, 1, generator=g)}
    path = rm.record_step(tmp_path, factory="build_custom_op_net", loss_fn="mse", batch=batch,
                          amp_dtype=torch.float16)
    r = replay_snapshot(path)
    _strict_json(r)
    assert r.verdict == "unregistered_op"
    assert r.culprit["op"] == "ampautopsy_replaytests.square" and r.culprit["custom"]
    assert r.culprit["input_dtypes"] == ["float16"] and r.culprit["module"] == "1"
    assert "register_autocast('ampautopsy_replaytests::square'" in r.advice[0]


def test_a_clean_model_at_scale_65536_is_a_loss_scale_overflow(scaled_sum_mse_step):
    # sum-reduced MSE with |out - y| ~ 3: dloss/dout * 65536 ~ 4e5 does not fit FP16
    r = replay_snapshot(scaled_sum_mse_step)
    _strict_json(r)
    assert r.verdict == "loss_scale_overflow"
    assert r.scale == 65536.0
    assert r.runs["float16"]["forward_finite"] and r.runs["float16"]["finite_at_scale_1"]
    assert (r.culprit["phase"], r.culprit["op"], r.culprit["node"]) == ("backward", "aten._to_copy", "ToCopyBackward0")


def test_a_healthy_snapshot_is_healthy_with_no_culprit(healthy_mlp_step):
    r = replay_snapshot(healthy_mlp_step, dtypes=["bf16"])
    _strict_json(r)
    assert r.verdict == "healthy" and r.culprit is None
    assert set(r.runs) == {"float32", "float16", "bfloat16"}
    assert all(run["finite"] and run["first_nonfinite"] is None for run in r.runs.values())
    # the FP16 replay computes the same loss the training step recorded
    assert r.runs["float16"]["loss"] == pytest.approx(r.recorded_loss, rel=1e-6)


def test_a_log_hidden_by_where_is_reported_when_its_backward_divides_zero_by_zero(tmp_path):
    g = _gen()
    batch = {"x": torch.randn(4, 4, generator=g), "w": torch.tensor([[1.0], [0.0], [1.0], [1.0]])}
    path = rm.record_step(tmp_path, factory="build_mlp", loss_fn="where_log_loss", batch=batch,
                          amp_dtype=torch.float16)
    r = replay_snapshot(path)
    _strict_json(r)
    assert r.verdict == "numerical_bug"
    assert (r.culprit["op"], r.culprit["phase"], r.culprit["node"]) == ("aten.div", "backward", "LogBackward0")
    assert r.runs["float32"]["forward_finite"]  # where hid the -inf from the loss
    assert (r.hidden_nonfinite["op"], r.hidden_nonfinite["phase"]) == ("aten.log", "forward")


def _wide_logits_snapshot(tmp_path, device_type: str):
    model = rm.build_wide_logits()
    batch = {"x": torch.tensor([[1.0, 0, 0, 0]]), "y": torch.tensor([2])}
    snap = build_snapshot(step=7, reason="nonfinite_loss", model=model, batch=batch,
                          rng={"cpu": torch.get_rng_state(), "cuda": None},
                          factory=f"{rm.REF}:build_wide_logits", factory_kwargs={},
                          loss_fn=f"{rm.REF}:log_softmax_nll", amp_dtype=torch.float16,
                          device_type=device_type)
    return write_snapshot(tmp_path / f"{device_type}.pt", snap)


def test_log_softmax_overflows_in_fp16_under_cpu_autocast_policy(tmp_path):
    # logits +-40000 fit FP16, but log p = -80000 does not; CPU autocast keeps log_softmax in FP16
    r = replay_snapshot(_wide_logits_snapshot(tmp_path, "cpu"), device="cpu")
    _strict_json(r)
    assert r.verdict == "overflow" and r.culprit["op"] == "aten._log_softmax"
    assert r.device_note is None


def test_a_cuda_snapshot_replayed_on_cpu_runs_log_softmax_in_fp32_as_cuda_autocast_would(tmp_path):
    r = replay_snapshot(_wide_logits_snapshot(tmp_path, "cuda"), device="cpu")
    _strict_json(r)
    assert r.verdict == "healthy"
    assert r.runs["float16"]["emulated_cuda_fp32_calls"] >= 1
    assert "recorded on cuda, replayed on cpu" in r.device_note and "emulated" in r.device_note


def test_replay_leaves_the_callers_rng_state_untouched(tmp_path):
    path = _wide_logits_snapshot(tmp_path, "cpu")
    before = torch.get_rng_state()
    replay_snapshot(path, device="cpu")
    assert torch.equal(torch.get_rng_state(), before)


def test_progress_draws_a_bar_on_stderr_only_when_asked(tmp_path, capsys):
    g = _gen()
    path = rm.record_step(tmp_path, factory="build_deep_mlp", loss_fn="mse", amp_dtype=torch.bfloat16,
                          batch={"x": torch.randn(4, 4, generator=g), "y": torch.randn(4, 1, generator=g)},
                          manual=True)
    replay_snapshot(path, device="cpu")
    assert capsys.readouterr().err == ""
    replay_snapshot(path, device="cpu", progress=True)
    err = capsys.readouterr().err
    assert "replay [" in err and "2/2 bfloat16 forward+backward" in err
    assert "256 ops" in err  # 42 linear layers: several hundred ops per run, counted as they go


def test_a_recorded_nan_that_does_not_reproduce_is_not_reproduced_never_healthy(tmp_path):
    model = rm.build_mlp()
    g = _gen()
    snap = build_snapshot(step=5, reason="nonfinite_loss", model=model,
                          batch={"x": torch.randn(4, 4, generator=g), "y": torch.randn(4, 1, generator=g)},
                          rng={"cpu": torch.get_rng_state(), "cuda": None}, factory=f"{rm.REF}:build_mlp",
                          factory_kwargs={}, loss_fn=f"{rm.REF}:mse", amp_dtype=torch.bfloat16,
                          device_type="cpu", loss=float("nan"))
    r = replay_snapshot(write_snapshot(tmp_path / "s.pt", snap))
    _strict_json(r)
    assert r.verdict == "not_reproduced"
    assert "fail with a NaN/Inf loss (loss nan)" in r.summary and "the failure did not reproduce" in r.summary


def test_dropout_masks_are_replayed_from_the_recorded_rng_state(tmp_path):
    g = _gen()
    batch = {"x": torch.randn(16, 4, generator=g), "y": torch.randn(16, 1, generator=g)}
    torch.manual_seed(1234)  # the training process's RNG is somewhere else than the replay's
    path = rm.record_step(tmp_path, factory="build_dropout_mlp", loss_fn="mse", batch=batch,
                          amp_dtype=torch.bfloat16, manual=True)
    torch.manual_seed(99)
    r = replay_snapshot(path)
    _strict_json(r)
    # p=0.5 dropout on 16x64 activations: a different mask would change the loss by far more than 1e-6
    assert r.runs["bfloat16"]["loss"] == pytest.approx(r.recorded_loss, rel=1e-6)
    assert r.runs["float32"]["loss"] == pytest.approx(r.recorded_loss, rel=2e-2)  # same mask, FP32 maths


def test_an_fp32_run_replays_fp32_only_unless_more_dtypes_are_asked_for(tmp_path):
    g = _gen()
    batch = {"x": torch.randn(4, 4, generator=g), "y": torch.randn(4, 1, generator=g)}
    path = rm.record_step(tmp_path, factory="build_mlp", loss_fn="mse", batch=batch, amp_dtype=None, manual=True)
    assert list(replay_snapshot(path).runs) == ["float32"]
    r = replay_snapshot(path, dtypes=["bf16", "fp16", "float16"])  # aliases of one dtype count once
    _strict_json(r)
    assert list(r.runs) == ["float32", "bfloat16", "float16"] and r.amp_dtype is None


def test_a_probability_that_rounds_to_zero_in_fp16_is_an_underflow_at_softmax(tmp_path):
    # gain 10: p(class 2) = exp(-40) ~ 4e-18, fine in FP32, below FP16's smallest subnormal (6e-8)
    batch = {"x": torch.tensor([[2.0, 0, 0, 0], [1.0, 0, 0, 0]]), "y": torch.tensor([2, 0])}
    path = rm.record_step(tmp_path, factory="build_classifier", loss_fn="log_prob_loss", batch=batch,
                          amp_dtype=torch.float16, factory_kwargs={"gain": 10.0})
    r = replay_snapshot(path)
    _strict_json(r)
    assert r.verdict == "underflow" and r.runs["float32"]["finite"]
    assert (r.culprit["op"], r.culprit["precision"]) == ("aten.log", "float16")
    assert r.underflow_at["op"] == "aten._softmax"
    # FP16 zeros: row (20, 0, -20) loses exp(-20) ~ 2e-9 and exp(-40); row (10, 0, -10) loses exp(-20)
    assert (r.underflow_at["zeros"], r.underflow_at["fp32_zeros"]) == (3, 0)

"""Replay's advice names only the tools the run uses: a GradScaler, autocast, its precision mode.

Every case is a real recorded step whose weights were already NaN before it (a fault injected
before the step, as an earlier broken update leaves them), replayed for real: the verdict is
``nonfinite_input``, and what keeps the next optimizer step from writing NaN/Inf into the weights
depends on whether the run has a GradScaler and how it is low precision.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from analyzer.replay import Diagnosis, advice_with_status, replay_snapshot, try_fixes
from analyzer.replay.verdicts import registry as verdicts
from recorders import Recorder
from tests import update_runs as ur

from . import replay_models as rm

_UNSCALE = "scaler.unscale_(optimizer)"
_STEP = "scaler.step(optimizer)"
_ADD_SCALER = "add torch.amp.GradScaler"


def _poison(model) -> None:
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("nan")  # what an earlier broken update leaves


def _mlp_step(tmp_path: Path, *, scaler: bool) -> Path:
    """One FP16-autocast step of ``build_mlp`` with a NaN weight, with or without a GradScaler."""
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(4, 4, generator=g), "y": torch.randn(4, 1, generator=g)}
    return rm.record_step(tmp_path, factory="build_mlp", loss_fn="mse", batch=batch, amp_dtype=torch.float16,
                          inject=_poison, init_scale=1024.0 if scaler else None)


def _pure_step(tmp_path: Path, dtype: str) -> Path:
    """One step of ``update_runs.build_linear`` in `dtype` parameters (no autocast, no GradScaler), NaN weight."""
    model = ur.build_linear(dtype)
    _poison(model)
    batch = {"x": torch.randn(4, 4, generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype)),
             "y": torch.zeros(4, 1)}
    with Recorder(tmp_path, model, factory=f"{ur.REF}:build_linear", factory_kwargs={"dtype": dtype},
                  loss_fn=f"{ur.REF}:regression_loss") as rec:
        rec.begin_step(0, batch)
        loss = ur.regression_loss(model, batch)
        loss.backward()
        assert rec.end_step(loss) is not None
    return rec.snapshots[-1]


def _replay(snap: Path):
    r = replay_snapshot(snap)
    assert r.verdict == "nonfinite_input" and r.nonfinite_inputs and r.nonfinite_inputs[0].startswith("param:")
    return r


def _text(r) -> str:
    return " ".join(r.advice)


def test_a_scaled_fp16_run_with_nan_weights_is_told_to_clip_after_unscale_and_step_through_the_scaler(tmp_path):
    r = _replay(_mlp_step(tmp_path, scaler=True))
    assert r.scale == 1024.0
    assert _UNSCALE in _text(r) and _STEP in _text(r) and _ADD_SCALER not in _text(r)


def test_an_fp16_autocast_run_without_a_scaler_is_told_to_add_one_not_to_call_its_methods(tmp_path):
    r = _replay(_mlp_step(tmp_path, scaler=False))
    assert r.precision_mode == "autocast" and r.amp_dtype == "float16"
    text = _text(r)
    assert "This FP16 autocast run has no GradScaler: add torch.amp.GradScaler" in text
    assert not [a for a in r.advice if a.startswith(("Lower the learning rate and clip gradients (",
                                                     "Make sure the optimizer steps through"))]
    assert "error_if_nonfinite=True" in text  # clipping an inf norm without a scaler writes NaN


def test_a_pure_bf16_run_is_told_to_skip_non_finite_steps_itself_and_never_to_call_a_scaler(tmp_path):
    r = _replay(_pure_step(tmp_path, "bfloat16"))
    assert (r.precision_mode, r.precision_dtype) == ("parameters", "bfloat16")
    text = _text(r)
    assert "scaler." not in text and _ADD_SCALER not in text
    assert "optimizer.step() only when torch.isfinite(total)" in text and "a BF16 run needs no GradScaler" in text


def test_a_pure_fp16_run_is_told_that_no_scaler_can_guard_fp16_parameters_and_to_keep_fp32_master_weights(tmp_path):
    r = _replay(_pure_step(tmp_path, "float16"))
    assert (r.precision_mode, r.precision_dtype) == ("parameters", "float16")
    text = _text(r)
    assert "scaler.unscale_ refuses FP16 gradients" in text and "Keep FP32 master weights" in text
    assert _UNSCALE not in text and _STEP not in text and _ADD_SCALER not in text


def test_the_unscale_refusal_the_fp16_advice_states_is_what_torch_does():
    # the advice above rests on this: GradScaler cannot unscale the gradients of FP16 parameters
    model = ur.build_linear("float16")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 4, dtype=torch.float16)).float().sum()).backward()
    with pytest.raises(ValueError, match="FP16 gradients"):
        scaler.unscale_(opt)


def test_an_fp32_run_without_a_scaler_gets_the_skip_advice_for_fp32(tmp_path):
    r = _replay(_pure_step(tmp_path, "float32"))
    assert r.precision_dtype is None and "a FP32 run needs no GradScaler" in _text(r)
    assert "scaler." not in _text(r)


@pytest.mark.parametrize("verdict", ["overflow", "underflow", "loss_scale_overflow"])
def test_a_bf16_culprit_is_never_told_to_switch_to_bf16(verdict):
    c = {"module": "m", "op": "aten.mm", "phase": "forward", "precision": "bfloat16", "node": None, "index": 0,
         "input_absmax": 1.0}
    lines = verdicts.advice(Diagnosis(verdict, c, scale=65536.0))
    assert lines and not [a for a in lines if "bf16" in a.fixes]
    fp16 = verdicts.advice(Diagnosis(verdict, {**c, "precision": "float16"}, scale=65536.0))
    assert [a for a in fp16 if "bf16" in a.fixes]  # the same step in FP16 does get it



@pytest.fixture(scope="module")
def pure_fp16_overflow(tmp_path_factory):
    """A pure-FP16 (no autocast, no GradScaler) step whose backward overflows FP16 and fits BF16:
    the MSE gradient 2 * (out - 1e6) / 4 ~ -5e5 is cast to float16 for the model's backward: -inf."""
    model = ur.build_linear("float16")
    batch = {"x": torch.ones(4, 4, dtype=torch.float16), "y": torch.full((4, 1), 1e6)}
    with Recorder(tmp_path_factory.mktemp("pure_fp16"), model, factory=f"{ur.REF}:build_linear",
                  factory_kwargs={"dtype": "float16"}, loss_fn=f"{ur.REF}:regression_loss") as rec:
        rec.begin_step(0, batch)
        loss = ur.regression_loss(model, batch)
        loss.backward()
        assert rec.end_step(loss) == "nonfinite_grads"
    snap = rec.snapshots[-1]
    r = replay_snapshot(snap)
    assert (r.verdict, r.precision_mode, r.culprit["module"]) == ("overflow", "parameters", "<loss_fn>")
    fixes = try_fixes(snap, r)
    return r, {f.name: f for f in fixes}, advice_with_status(r, fixes)


def test_a_pure_fp16_run_verified_by_bf16_is_told_to_cast_its_parameters_not_to_use_autocast(pure_fp16_overflow):
    _, fixes, advice = pure_fp16_overflow
    assert fixes["bf16"].status == "verified"
    line, = [a for a in advice if a.fix == "bf16"]
    assert line.status == "verified" and "model.to(torch.bfloat16)" in line.text and "autocast" not in line.text
    # mode_advice's own "Or train in bfloat16" is the same fix: replaced by the verified line, not repeated
    r, _, _ = pure_fp16_overflow
    own = [a.text for a in r.advice_lines if "bf16" in a.fixes]
    assert own and not [a for a in advice if a.text in own]


def test_a_pure_fp16_run_verified_by_a_lower_scale_is_told_to_scale_the_loss_itself_not_to_start_a_gradscaler(
        pure_fp16_overflow):
    _, fixes, advice = pure_fp16_overflow
    s = fixes["lower_scale"].max_safe_scale
    assert fixes["lower_scale"].status == "verified" and s < 1
    line, = [a for a in advice if a.fix == "lower_scale"]
    assert f"(loss * {s:g}).backward()" in line.text and "GradScaler(init_scale" not in line.text


def test_a_culprit_in_the_loss_function_is_never_told_to_call_float_on_a_module_named_loss_fn(pure_fp16_overflow):
    r, _, advice = pure_fp16_overflow
    assert not [a for a in r.advice + [a.text for a in advice] if "`<loss_fn>`" in a]
    assert any(a.text.startswith("Compute the loss in FP32") for a in advice)


def test_an_fsdp_bf16_run_with_nan_weights_is_told_to_skip_non_finite_steps_and_never_to_call_a_scaler(
        tmp_path_factory):
    from tests import fsdp_runs as fr

    if not fr.fsdp_available():
        pytest.skip("needs FSDP2, DCP and gloo")
    runs = fr.shared_fsdp_runs(tmp_path_factory)  # one spawn per session, shared with test_fsdp_replay.py
    name = f"step{fr.FAULT_STEP:08d}-r{fr.FAULT_RANK:05d}-nonfinite_loss.pt"
    r = _replay(runs.dirs["synced"] / "snapshots" / name)
    assert (r.precision_mode, r.precision_dtype) == ("fsdp_param_dtype", "bfloat16")
    text = _text(r)
    assert "scaler." not in text and _ADD_SCALER not in text and "a BF16 run needs no GradScaler" in text


def test_the_fp32_clip_inf_update_is_told_to_skip_the_step_itself_not_to_use_a_gradscaler(clip_inf_update_run):
    snap = next(p for p in clip_inf_update_run["snapshots"] if p.stem.endswith("-update"))
    r = replay_snapshot(snap)
    assert (r.verdict, r.culprit["phase"], r.amp_dtype) == ("numerical_bug", "optimizer", None)
    text = _text(r)
    assert "GradScaler" not in text and "error_if_nonfinite=True" in text and "torch.isfinite(total_norm)" in text


# -- learning-rate and growth advice only for a value derived from the weights ----------------------
_LR = ("learning rate", "weight decay")


def _nan_batch_step(tmp_path: Path) -> Path:
    """One FP16-autocast step of ``build_mlp`` on a batch with a NaN, the weights intact."""
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(4, 4, generator=g), "y": torch.randn(4, 1, generator=g)}
    batch["x"][1, 2] = float("nan")
    return rm.record_step(tmp_path, factory="build_mlp", loss_fn="mse", batch=batch, amp_dtype=torch.float16)


def test_a_nan_in_the_batch_alone_gets_no_learning_rate_advice_and_nan_weights_do(tmp_path):
    batch_only = replay_snapshot(_nan_batch_step(tmp_path / "batch"))
    assert batch_only.verdict == "nonfinite_input" and batch_only.nonfinite_inputs == ["batch:x"]
    assert "data pipeline" in _text(batch_only)
    assert not any(w in a for a in batch_only.advice for w in _LR), batch_only.advice
    weights = _replay(_mlp_step(tmp_path / "weights", scaler=True))
    assert any(a.startswith("Lower the learning rate") for a in weights.advice)


@pytest.mark.parametrize("project, advised", [(False, False), (True, True)])
def test_an_overflow_gets_growth_advice_only_when_an_op_upstream_read_a_parameter(tmp_path, project, advised):
    # x @ x^T of a batch scaled to ~300 overflows FP16 inside the module `gram`: no parameter upstream, though
    # the op runs in a module; with `project`, the rows are the batch times the weights
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g) * (1.0 if project else 300.0)
    batch = {"x": x, "y": torch.zeros(4, 1)}
    snap = rm.record_step(tmp_path, factory="build_gram", loss_fn="mse", batch=batch, amp_dtype=torch.float16,
                          factory_kwargs={"project": project})
    r = replay_snapshot(snap)
    assert r.verdict == "overflow" and (r.culprit["op"], r.culprit["module"]) == ("aten.mm", "gram"), r.summary
    assert any("learning rate" in a for a in r.advice) is advised, r.advice

"""Finite steps against FP32: ``precision_error`` at the op where the error is born, its fix judged against FP32.

The models are ``finite_error_models.py``: a one-pass variance E[h^2] - E[h]^2 on activations centred on 8, in BF16
(no GradScaler) and in FP16 (GradScaler at its default init_scale, backed off by the first steps), and the same
normalisation in two passes, whose step stays within tolerance.
"""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main
from analyzer.replay import Replay
from analyzer.replay.detection._compare import GRAD_K, LOSS_K
from tests.analyzer.replay.finite_error_models import SIN_LINE, VARIANCE_LINE, norm_batch, positions_batch, record_step

_STEPS = {}


def _snapshot(tmp_path_factory, dtype, two_pass=False):
    key = (dtype, two_pass)
    if key not in _STEPS:
        scaler = dtype == torch.float16
        _STEPS[key] = record_step(tmp_path_factory.mktemp("norm") / "run", dtype, factory="build_norm",
                                  loss_fn="norm_loss", batch=norm_batch(), scaler=scaler, steps=4 if scaler else 1,
                                  two_pass=two_pass)
    return _STEPS[key]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_one_pass_variance_is_a_precision_error_born_at_its_subtraction_and_fixed_in_fp32(tmp_path_factory, dtype):
    replay = Replay(_snapshot(tmp_path_factory, dtype), device="cpu")
    res = replay.run()
    assert res.verdict == "precision_error"
    assert all(r["finite"] for r in res.runs.values())  # no NaN anywhere: the step is only wrong
    c = res.culprit
    # E[h^2] - E[h]^2: each operand rounds correctly; the subtraction of two close values amplifies that rounding
    assert (c["op"], c["module"], c["phase"]) == ("aten.sub", "norm", "forward")
    assert c["source"].endswith(f"finite_error_models.py:{VARIANCE_LINE}")
    pe = c["precision_error"]
    assert pe["kind"] == "amplified" and pe["local_error_eps"] < 1 and pe["error_eps"] > 50 > pe["input_error_eps"]
    assert pe["accounts_for"]["grad"] > 0.9  # the FP32 values of its inputs remove almost all the gradient's error
    cmp = res.evidence["fp32_comparison"].comparison
    assert cmp.grad_eps > GRAD_K and cmp.beyond
    fixes = {f.name: f for f in replay.try_fixes(res)}
    assert fixes["born_fp32"].status == "verified", fixes["born_fp32"].detail
    assert fixes["module_fp32"].status == "verified", fixes["module_fp32"].detail  # `norm` kept in FP32


def test_a_two_pass_variance_stays_healthy_and_its_comparison_is_in_the_json(tmp_path_factory):
    path = _snapshot(tmp_path_factory, torch.bfloat16, two_pass=True)
    res = CliRunner().invoke(main, ["replay", str(path), "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.output[res.output.index("{"):])
    assert obj["verdict"] == "healthy" and obj["culprit"] is None
    cmp = obj["fp32_comparison"]
    assert cmp["beyond_tolerance"] is False and cmp["precision"] == "bfloat16"
    assert cmp["loss_error_eps"] <= LOSS_K and cmp["grad_error_eps"] <= GRAD_K and cmp["grad_cosine"] > 0.999
    assert {w["param"] for w in cmp["worst_params"]} <= {"inp.weight", "inp.bias", "out.weight", "out.bias"}


def test_replay_json_of_a_precision_error_names_the_op_and_the_comparison(tmp_path_factory):
    path = _snapshot(tmp_path_factory, torch.bfloat16)
    res = CliRunner().invoke(main, ["replay", str(path), "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.output[res.output.index("{"):])
    assert obj["verdict"] == "precision_error" and obj["culprit"]["op"] == "aten.sub"
    assert obj["fp32_comparison"]["beyond_tolerance"] is True
    assert obj["culprit"]["precision_error"]["kind"] == "amplified"


@pytest.mark.parametrize("fp32_positions, verdict", [(False, "precision_error"), (True, "healthy")])
def test_positions_counted_in_bf16_past_256_are_a_precision_error_amplified_where_they_are_used(
        tmp_path, fp32_positions, verdict):
    # ones.cumsum(-1) in BF16 rounds 257 to 256 (CPU cumsum adds in FP32 and rounds each output once): each
    # position is within half an eps, and sin(position * freq) of a rounded position past 256 is far off
    path = record_step(tmp_path, torch.bfloat16, factory="build_positions", loss_fn="norm_loss",
                       batch=positions_batch(), fp32_positions=fp32_positions)
    replay = Replay(path, device="cpu")
    res = replay.run()
    assert res.verdict == verdict
    if verdict == "healthy":
        return
    c = res.culprit
    assert c["op"] == "aten.sin" and c["source"].endswith(f"finite_error_models.py:{SIN_LINE}")
    pe = c["precision_error"]
    assert pe["kind"] == "amplified" and pe["input_error_eps"] < 1 < 10 < pe["error_eps"]
    # the angle made in FP32 and kept so feeds the cos beside the sin too: nearly all the error goes
    assert pe["accounts_for"]["grad"] > 0.9
    fixes = {f.name: f for f in replay.try_fixes(res)}
    assert fixes["born_fp32"].status == "verified", fixes["born_fp32"].detail
    assert "keep them in FP32" in fixes["born_fp32"].title


def test_a_step_with_dropout_blames_the_normalisation_not_the_dropout(tmp_path):
    # the error pass recomputes ops in FP32: a dropout mask drawn again, or its in-place scaling (div_) applied
    # twice, would look like an op computing far from FP32; the mask is the step's own, and div_ runs once
    path = record_step(tmp_path, torch.bfloat16, factory="build_norm", loss_fn="norm_loss", batch=norm_batch(),
                       dropout=0.1)
    replay = Replay(path, device="cpu")
    res = replay.run()
    assert res.verdict == "precision_error"
    c = res.culprit
    # the one-pass variance cancels; dividing by its root amplifies that most here (rows whose variance is small)
    assert c["module"] == "norm" and c["op"] in ("aten.sub", "aten.div") and c["precision_error"]["kind"] == "amplified"
    fixes = {f.name: f for f in replay.try_fixes(res)}
    assert fixes["born_fp32"].status == "verified", fixes["born_fp32"].detail

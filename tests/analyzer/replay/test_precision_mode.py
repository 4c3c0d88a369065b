"""Replay of pure FP16/BF16 training (parameters in low precision, no autocast): the parameter dtype is under test.

Every snapshot is written by the real ``Recorder`` around one real training step of a tiny CPU
model whose parameters are float16 or bfloat16 (``precision_models.py``). The faults do not
hinge on rounding: 400 * 400 is past float16's max on every CPU, and exp(-400) is 0 in FP32 too.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzer.cli import main
from analyzer.errors import BadInputError
from analyzer.render import render_replay_text
from analyzer.replay import replay_snapshot
from analyzer.replay.runs._precision import MODES, precision_mode

from . import precision_models as pm
from . import replay_models as rm

# x = (2, 0, 0, 0): the first Linear (200 * identity) gives 400, whose square 160000 > 65504
SQUARE_BATCH = {"x": torch.tensor([[2.0, 0, 0, 0], [1.0, 0, 0, 0]]), "y": torch.zeros(2, 1)}


@pytest.fixture(scope="module")
def fp16_square(tmp_path_factory):
    path = pm.record_pure_step(tmp_path_factory.mktemp("fp16sq"), factory="build_square_net", loss_fn="mse",
                               batch=SQUARE_BATCH, dtype=torch.float16)
    return path, replay_snapshot(path, dtypes=["fp16", "bf16"])


def test_the_recorded_pure_fp16_snapshot_holds_float16_weights_and_no_amp_dtype(fp16_square):
    snap = torch.load(fp16_square[0], weights_only=True)
    assert snap["amp_dtype"] is None
    assert {t.dtype for t in snap["model_state"].values()} == {torch.float16}


def test_pure_fp16_square_overflows_in_float16_at_the_mul_of_the_square_module(fp16_square):
    r = fp16_square[1]
    assert r.verdict == "overflow"
    c = r.culprit
    assert (c["op"], c["module"], c["phase"], c["precision"]) == ("aten.mul", "1", "forward", "float16")
    # the op really computed in float16 (parameters cast, no autocast), and 400^2 = 160000 in FP32
    assert c["input_dtypes"] == ["float16"] and c["output_dtype"] == "float16"
    assert c["input_absmax"] == 400.0 and c["shadow"]["float32"] == 160000.0


def test_pure_fp16_replay_reports_the_parameters_mode_and_no_amp_dtype(fp16_square):
    r = fp16_square[1]
    assert (r.precision_mode, r.precision_dtype, r.amp_dtype) == ("parameters", "float16", None)
    obj = json.loads(json.dumps(r.to_dict(), allow_nan=False))
    assert obj["precision_mode"] == "parameters" and obj["precision_dtype"] == "float16"
    assert "precision mode: parameters" in render_replay_text(r)


def test_the_fp32_run_of_a_pure_fp16_snapshot_upcasts_weights_and_batch_and_stays_finite(fp16_square):
    runs = fp16_square[1].runs
    # an FP32 loss proves the weights and the fp16 batch were upcast: mse of float16 tensors is float16
    assert runs["float32"]["finite"] and runs["float32"]["loss_dtype"] == "float32"
    assert not runs["float16"]["forward_finite"] and runs["float16"]["loss_dtype"] == "float16"


def test_bf16_asked_for_on_a_pure_fp16_snapshot_casts_the_parameters_to_bf16_where_160000_fits(fp16_square):
    runs = fp16_square[1].runs
    assert runs["bfloat16"]["finite"] and runs["bfloat16"]["loss_dtype"] == "bfloat16"


def test_pure_fp16_advice_names_fp32_master_weights_not_an_autocast_switch(fp16_square):
    text = " ".join(fp16_square[1].advice)
    assert "master weights" in text and "`1`.float()" in text
    assert "torch.autocast(device_type, enabled=False)" not in text


def test_a_factory_that_builds_the_model_in_fp16_replays_the_same_fp32_and_fp16_runs(tmp_path):
    path = pm.record_pure_step(tmp_path, factory="build_square_net", loss_fn="mse", batch=SQUARE_BATCH,
                               dtype=torch.float16, factory_kwargs={"dtype": "float16"})
    r = replay_snapshot(path)
    assert r.verdict == "overflow" and r.culprit["module"] == "1"
    assert r.runs["float32"]["finite"] and r.runs["float32"]["loss_dtype"] == "float32"


def test_pure_bf16_log_of_a_zero_probability_is_a_numerical_bug_in_fp32_too(tmp_path):
    # logits (200, 0, -200): p(class 2) = exp(-400) is exactly 0 in FP32 and in BF16
    batch = {"x": torch.tensor([[2.0, 0, 0, 0], [1.0, 0, 0, 0]]), "y": torch.tensor([2, 0])}
    path = pm.record_pure_step(tmp_path, factory="build_classifier", loss_fn="log_prob_loss", batch=batch,
                               dtype=torch.bfloat16)
    r = replay_snapshot(path)
    assert (r.precision_mode, r.precision_dtype) == ("parameters", "bfloat16")
    assert r.verdict == "numerical_bug"
    assert (r.culprit["op"], r.culprit["module"], r.culprit["precision"]) == ("aten.log", "<loss_fn>", "float32")
    assert not r.runs["float32"]["finite"] and not r.runs["bfloat16"]["finite"]
    assert r.runs["bfloat16"]["loss_dtype"] == "bfloat16"


def test_an_fp32_model_with_a_float16_buffer_but_fp32_parameters_replays_in_fp32_only(tmp_path):
    batch = {"x": torch.tensor([[2.0, 0, 0, 0], [1.0, 0, 0, 0]]), "y": torch.tensor([2, 0])}
    path = pm.record_pure_step(tmp_path, factory="build_classifier_with_half_buffer", loss_fn="log_prob_loss",
                               batch=batch, dtype=None)
    assert torch.load(path, weights_only=True)["model_state"]["table"].dtype == torch.float16
    r = replay_snapshot(path)
    # the parameters decide the mode: FP32 parameters without autocast are an FP32 run
    assert (r.precision_mode, r.precision_dtype) == ("autocast", None) and list(r.runs) == ["float32"]
    assert r.verdict == "numerical_bug"


def test_an_autocast_snapshot_replays_in_the_autocast_mode(tmp_path):
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(2, 8, 8, generator=g) * 10, "y": torch.randn(2, 8, 1, generator=g)}
    path = rm.record_step(tmp_path, factory="build_attention", loss_fn="attention_mse",
                          factory_kwargs={"d": 8, "gain": 8.0}, batch=batch, amp_dtype=torch.float16)
    r = replay_snapshot(path)
    assert (r.precision_mode, r.precision_dtype, r.amp_dtype) == ("autocast", "float16", "float16")
    # autocast runs keep FP32 parameters: the culprit's matmul inputs were cast by autocast
    assert r.verdict == "overflow" and r.culprit["op"] == "aten.bmm"
    assert "precision mode" not in render_replay_text(r)


def test_cli_replay_of_a_pure_fp16_snapshot_prints_the_precision_mode(fp16_square):
    res = CliRunner().invoke(main, ["replay", str(fp16_square[0]), "--json"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.output)
    assert obj["verdict"] == "overflow" and obj["precision_mode"] == "parameters"
    assert math.isfinite(obj["runs"]["float32"]["loss"])


_DTYPE_TEXT = st.one_of(st.none(), st.sampled_from(["float16", "bfloat16", "float32", "fp16", "bf16", "int8", "bool",
                                                    "torch.float16", "complex64"]),
                        st.text(max_size=12), st.integers(), st.floats(), st.lists(st.none(), max_size=2))


@settings(max_examples=200, deadline=None)
@given(policy=st.one_of(_DTYPE_TEXT, st.dictionaries(st.sampled_from(["param_dtype", "reduce_dtype", "output_dtype"]),
                                                     _DTYPE_TEXT)),
       amp=st.sampled_from([None, "float16", "bfloat16"]))
def test_any_fsdp_policy_read_from_a_snapshot_gives_a_known_mode_or_one_error_line(policy, amp):
    snap = {"fsdp": {"mp_policy": policy}}
    try:
        mode = precision_mode("x.pt", snap, amp, {"w": torch.zeros(2, dtype=torch.float16)})
    except BadInputError as e:
        assert "\n" not in str(e) and str(e).startswith("x.pt:")
    else:
        assert mode.kind in MODES
        low = isinstance(policy, dict) and mode.kind == "fsdp_param_dtype"
        assert not low or mode.dtype in ("float16", "bfloat16")
        assert mode.kind != "autocast" or mode.dtype == amp

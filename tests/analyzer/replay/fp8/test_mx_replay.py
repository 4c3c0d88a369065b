"""MXFP8 runs end to end: torchao's emulated MXFP8 training on CPU under the real Recorder, replayed from its
snapshot (the recipe rebuilt with ``MXFP8TrainingOpConfig``) in FP32, BF16 and MXFP8, and judged as FP8 runs are."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main
from tests.extras import require

from . import mx_models as mx

require("torchao.prototype.moe_training", "fp8")

pytestmark = pytest.mark.filterwarnings("ignore")


def _json(*args: str) -> dict:
    res = CliRunner().invoke(main, [*args, "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def massive_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("mx") / "run"
    return run, mx.train_mx(run, massive=True)


def test_the_recorders_mxfp8_snapshot_loads_with_weights_only_and_records_the_mx_recipe(massive_run):
    _, snaps = massive_run
    assert [p.name.endswith("-fp8.pt") for p in snaps] == [True]  # the recorder's own fp8 trigger
    data = torch.load(snaps[0], weights_only=True)  # the weights are plain tensors, not torchao's wrappers
    assert type(data["model_state"]["block.mlp.w2.weight"]) is torch.Tensor
    recipe = data["fp8_recipe"]
    assert set(recipe["modules"]) == {"block.mlp.w1", "block.mlp.w3", "block.mlp.w2", "block.qkv", "block.proj", "head"}
    cfg = recipe["configs"][0]
    assert cfg["kind"] == "mxfp8" and cfg["fields"]["scale_calculation_mode"] == "rceil"
    cast = {"format": "e4m3", "granularity": "mxfp8"}
    assert cfg["roles"]["grad_output"] == {**cast, "block_size": 32, "scale_rounding": "rceil",
                                           "uses": {"input gradient": cast, "weight gradient": cast}}


def test_an_mxfp8_step_whose_massive_channels_flush_w2s_input_autopsies_to_fp8_underflow(massive_run):
    run, snaps = massive_run
    fired = torch.load(snaps[0], weights_only=True)["fp8"]["fired"]
    a = _json("autopsy", str(run))
    assert a["verdict"] == "fp8_underflow"
    fp8 = a["replays"][0]["fp8"]
    first = fp8["first"]
    assert (first["module"], first["role"], first["phase"], first["use"]) == ("block.mlp.w2", "input", "forward",
                                                                            "forward")
    assert first["granularity"] == "mxfp8" and first["outlier"]["column"] in mx.MASSIVE
    # the replayed cast is the recorded one: the same values, the same e8m0 block scales, the same flushed count
    assert (first["flushed"], first["nonzero"]) == (fired["flushed"], fired["nonzero"])
    assert fp8["agrees_with_bf16"] is False and fp8["jump"]["layer"] == "block.mlp.w2"
    fixes = {f["name"]: f["status"] for f in a["fixes"]}
    assert fixes["fp8_keep_bf16"] == "verified"
    assert fixes["fp8_rowwise"] == "fails"  # each token's row holds a massive channel: rowwise flushes it too
    assert "fp8_mxfp8" not in fixes  # the step already trains in MXFP8 with RCEIL scales


def test_every_mx_cast_of_the_step_is_named_by_module_role_and_gemm(massive_run):
    from analyzer.replay import Replay

    _, snaps = massive_run
    ev = Replay(snaps[0], device="cpu").run().diagnosis.evidence["fp8"]
    w2 = [(c.phase, c.role, c.use, c.granularity) for c in ev.casts if c.module == "block.mlp.w2"]
    # torchao's mx_mm: input and weight forward; grad_output and weight for the input gradient, grad_output and
    # input for the weight gradient (wgrad_with_hp is off)
    assert w2 == [("forward", "input", "forward", "mxfp8"), ("forward", "weight", "forward", "mxfp8"),
                  ("backward", "grad_output", "input gradient", "mxfp8"), ("backward", "weight", "input gradient", "mxfp8"),
                  ("backward", "grad_output", "weight gradient", "mxfp8"), ("backward", "input", "weight gradient", "mxfp8")]
    assert len(ev.casts) == 6 * 6


def test_a_healthy_mxfp8_step_replays_with_no_fp8_finding(tmp_path):
    snaps = mx.train_mx(tmp_path / "run", snapshot=True)  # the plain model: the trigger wrote nothing, the loop did
    assert len(snaps) == 1
    r = _json("replay", str(snaps[0]))
    assert r["verdict"] == "healthy"
    assert r["fp8"]["verdict"] is None and r["fp8"]["breaking"] == [] and r["fp8"]["agrees_with_bf16"] is True
    assert r["fp8"]["casts"] == 36


def test_floor_block_scales_saturate_and_autopsy_verifies_rceil_against_bf16(tmp_path):
    # every weight is +-1.99 * 2**-6: FLOOR's e8m0 scale maps 1.99 * 2**k to 509 > 448, clamped by 12%, in every
    # block of every weight cast; the clamps compound through the SwiGLU and the step leaves BF16
    run = tmp_path / "run"
    snaps = mx.train_mx(run, top_binade=True, mode="floor")
    assert [p.name.endswith("-fp8.pt") for p in snaps] == [True]  # the recorder's trigger: saturated > 0.01%
    a = _json("autopsy", str(run))
    assert a["verdict"] == "fp8_saturation"
    fp8 = a["replays"][0]["fp8"]
    first = fp8["first"]
    assert first["granularity"] == "mxfp8_floor" and first["breaks"] == "saturation" and first["saturated"] > 0
    assert fp8["agrees_with_bf16"] is False
    fixes = {f["name"]: f for f in a["fixes"]}
    assert fixes["fp8_mxfp8"]["status"] == "verified" and "RCEIL" in fixes["fp8_mxfp8"]["title"]
    assert "the unchanged FP8 step fails the same test" in fixes["fp8_mxfp8"]["detail"]
    assert "fp8_e5m2_grads" not in fixes  # MXFP8 training casts every operand to e4m3: no e5m2 option to try


def test_the_same_weights_under_rceil_block_scales_saturate_nothing_and_replay_healthy(tmp_path):
    snaps = mx.train_mx(tmp_path / "run", top_binade=True, mode="rceil", snapshot=True)
    assert len(snaps) == 1  # the loop's own snapshot: the trigger wrote none
    r = _json("replay", str(snaps[0]))
    assert r["verdict"] == "healthy" and r["fp8"]["verdict"] is None and r["fp8"]["breaking"] == []


def test_an_mxfp8_snapshot_recorded_under_bf16_autocast_replays_on_cpu(massive_run, tmp_path):
    # as a CUDA run under autocast writes it: FP32 master weights, amp_dtype bfloat16, the same MX recipe. torchao
    # 0.18's emulated mx_mm refuses autocast's FP32 weight beside a BF16 input, so the replay computes the MX
    # GEMMs on operands in BF16 (what autocast rounds a Linear's operands to)
    _, snaps = massive_run
    data = torch.load(snaps[0], weights_only=True)
    data["model_state"] = {k: v.float() for k, v in data["model_state"].items()}
    data["amp_dtype"] = "bfloat16"
    path = tmp_path / "autocast-mx.pt"
    torch.save(data, path)
    r = _json("replay", str(path))
    assert r["precision_mode"] == "autocast" and r["verdict"] == "fp8_underflow"
    first = r["fp8"]["first"]
    assert (first["module"], first["role"], first["granularity"]) == ("block.mlp.w2", "input", "mxfp8")


def test_an_mxfp8_snapshot_without_torchao_is_one_error_line_naming_the_fp8_extra(massive_run, monkeypatch):
    _, snaps = massive_run
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)  # torchao absent, as without the [fp8] extra
    res = CliRunner().invoke(main, ["replay", str(snaps[0]), "--device", "cpu"])
    assert res.exit_code != 0
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "[fp8]" in lines[0], res.output


def test_a_factory_that_returns_the_mxfp8_model_replays_the_same_casts(massive_run, tmp_path):
    # its FP32 and BF16 runs use the plain twin (each MX weight back to a plain parameter of the same values)
    _, snaps = massive_run
    data = torch.load(snaps[0], weights_only=True)
    del data["fp8_recipe"]  # the converted factory's model alone carries the recipe
    path = tmp_path / "no-recipe.pt"
    torch.save(data, path)
    r = _json("replay", str(path), "--factory", f"{mx.REF}:build_mx")
    first, fired = r["fp8"]["first"], data["fp8"]["fired"]
    assert r["verdict"] == "fp8_underflow" and first["granularity"] == "mxfp8"
    assert (first["module"], first["role"], first["flushed"]) == (fired["module"], fired["role"], fired["flushed"])
    assert r["runs"]["bfloat16"]["finite"] and r["fp8"]["bf16_agrees_with_fp32"] is True

"""``small_input``: an overflow that is large because an input is small names that input and the cast upstream."""
from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from analyzer.cli import main

from . import denoiser_models as dm


def _line(text: str) -> str:
    n = next(i for i, t in enumerate(open(dm.__file__), 1) if text in t)
    return f"tests/analyzer/replay/denoiser_models.py:{n}"


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    crashed = dm.train_until_nonfinite(tmp_path_factory.mktemp("small"), save_rng="batch")
    args = ["replay", str(crashed["checkpoint"]), "--batch", str(crashed["batch"]), "--factory",
            f"{dm.REF}:build_denoiser", "--loss-fn", f"{dm.REF}:denoiser_loss"]
    return json.loads(CliRunner().invoke(main, [*args, "--json"]).output), CliRunner().invoke(main, args).output


def test_the_reciprocal_names_its_smallest_input_the_pow_that_made_it_and_the_cast(replayed):
    out, _ = replayed
    ev = out["small_input"]
    assert out["verdict"] == "overflow" and ev["op"] == "aten.reciprocal" and ev["dtype"] == "float16"
    # 1 / x passes FP16's 65504 exactly when x < 1/65504 = 1.53e-5
    assert 0 < ev["smallest_nonzero_abs"] < 1 / 65504 and ev["zeros"] == 0
    assert (ev["producer"]["op"], ev["producer"]["source"]) == ("aten.pow", _line("weight = 1 / sigma ** 2"))
    assert (ev["cast"]["op"], ev["cast"]["source"]) == ("aten._to_copy", _line("sigma = sigma.to(pred.dtype)"))


def test_the_summary_and_the_advice_name_the_cast_line(replayed):
    out, text = replayed
    cast = _line("sigma = sigma.to(pred.dtype)")
    assert "Its input was small, not large" in out["summary"] and "became float16 at aten._to_copy" in out["summary"]
    assert any(a.startswith(f"Keep this value in FP32 from the cast at {cast}") for a in out["advice"])
    assert cast in text


def test_keeping_that_region_in_fp32_is_verified_against_fp32_at_the_scale_gradscaler_backs_off_to(tmp_path):
    crashed = dm.train_until_nonfinite(tmp_path, save_rng="batch")
    res = CliRunner().invoke(main, ["autopsy", str(crashed["checkpoint"]), "--batch", str(crashed["batch"]),
                                    "--factory", f"{dm.REF}:build_denoiser", "--loss-fn",
                                    f"{dm.REF}:denoiser_loss", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    [fix] = [f for f in out["fixes"] if f["name"] == "region_fp32"]
    cast, culprit = _line("sigma = sigma.to(pred.dtype)"), _line("weight = 1 / sigma ** 2")
    assert fix["status"] == "verified" and cast in fix["title"] and culprit in fix["title"]
    # the weight 1/sigma**2 ~ 8e4 makes the FP16 gradients large: verified where GradScaler's back-offs land
    recorded = out["replays"][0]["scale"]
    s = fix["max_safe_scale"]
    assert s is not None and s < recorded and s == 2 ** round(math.log2(s))
    assert f"backs off to {s:g}" in fix["detail"] and abs(fix["loss"] - fix["reference_loss"]) <= 1e-2 * abs(fix["reference_loss"])


def test_advice_fits_a_loss_that_draws_the_models_input_and_a_value_that_does_not_come_from_the_weights(tmp_path):
    crashed = dm.train_until_nonfinite(tmp_path, save_rng="batch")
    out = json.loads(CliRunner().invoke(main, [
        "autopsy", str(crashed["checkpoint"]), "--batch", str(crashed["batch"]), "--factory",
        f"{dm.REF}:build_denoiser", "--loss-fn", f"{dm.REF}:denoiser_loss", "--json"]).output)
    lines = [a["text"] for a in out["advice"]]
    noise = _line("pred = model(x + sigma * noise)")
    # "compute the loss in FP32" would run the model in FP32 too: the loss function computes its input
    assert any(t.startswith("Computing the loss in FP32 would run the whole model in FP32") and noise in t for t in lines)
    assert not any(t.startswith("Compute the loss in FP32") for t in lines)
    [module_fix] = [f for f in out["fixes"] if f["name"] == "module_fp32"]
    assert "would run the whole model in FP32 too" in module_fix["detail"]
    # 1/sigma**2 comes from a random draw alone: no learning-rate advice
    assert not any("learning rate" in t for t in lines)


def test_the_op_table_and_the_json_read_the_cast_as_float32_to_float16(replayed):
    out, text = replayed
    cast = _line("sigma = sigma.to(pred.dtype)")
    table = text.split("ops around the culprit (float16):\n")[1].split("\n\n")[0].splitlines()
    [row] = [r for r in table if "aten._to_copy" in r and r.rstrip().endswith(cast)]
    assert " float32 -> float16 " in row
    # the pow that follows reads and writes float16: its row is no cast
    [pow_row] = [r for r in table if "aten.pow" in r and r.rstrip().endswith(_line("weight = 1 / sigma ** 2"))]
    assert " float16 -> float16 " in pow_row
    ev = out["small_input"]["cast"]
    assert (ev["input_dtypes"], ev["output_dtype"]) == (["float32"], "float16")
    assert "(float32 -> float16)" in out["summary"]
    [op] = [o for o in out["context_ops"] if o["index"] == ev["index"]]
    assert (op["op"], op["input_dtypes"], op["output_dtype"]) == ("aten._to_copy", ["float32"], "float16")

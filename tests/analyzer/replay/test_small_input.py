"""``small_input``: an overflow that is large because an input is small names that input and the cast upstream."""
from __future__ import annotations

import json

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

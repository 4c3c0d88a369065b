"""`analyzer autopsy` on a failure born in the optimizer update (a real pure-FP16 Adam run)."""
from __future__ import annotations

import json

from click.testing import CliRunner

from analyzer.cli import main


def test_an_update_born_nan_is_answered_from_the_update_forensics_without_forward_backward_wording(
        fp16_adam_eps_update_run):
    info = fp16_adam_eps_update_run  # tests/conftest.py: record_fp16_adam_eps(check_update=True), once per session
    text = CliRunner().invoke(main, ["autopsy", str(info["run_dir"])])
    assert text.exit_code == 0, text.output
    answer = text.output.split("evidence 1/")[0]
    assert "verdict: underflow" in answer and "adam.update in <optimizer: Adam>, optimizer, float16" in answer
    assert "emb.weight" in answer and "eps" in answer
    # the optimizer is the culprit: no "look at the input", no "forward and backward only" caveat
    assert "look at the" not in answer and "forward and backward only" not in answer
    assert "not tried: change the optimizer's settings" in answer
    assert "(amp-autopsy run, float16 parameters, no AMP," in text.output  # the report's header: model.half(), no autocast

    out = CliRunner().invoke(main, ["autopsy", str(info["run_dir"]), "--json"])
    doc = json.loads(out.output)
    assert doc["verdict"] == "underflow" and doc["culprit"]["phase"] == "optimizer"
    assert [f["status"] for f in doc["fixes"]] == ["not_tried"]
    assert doc["report"]["findings"][0]["check"] == "nonfinite_weights"

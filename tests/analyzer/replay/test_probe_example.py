"""A probe and a verdict defined outside the package (``log_zeros_probe.py``) flow through a real replay:
``replay --json``, ``autopsy --json`` and the autopsy's text answer, with nothing else edited."""
from __future__ import annotations

import importlib
import json
import sys

import pytest
from click.testing import CliRunner

from analyzer.cli import main
from analyzer.replay import PROBES, VERDICTS

_MODULE = "tests.analyzer.replay.log_zeros_probe"


@pytest.fixture
def log_zeros_probe():
    """Import the probe's module (registering its probe and verdict); unregister both afterwards."""
    sys.modules.pop(_MODULE, None)
    module = importlib.import_module(_MODULE)
    yield module
    PROBES.pop("log_zeros", None)
    VERDICTS.pop(module.VERDICT, None)
    sys.modules.pop(_MODULE, None)


def _json(*args: str) -> dict:
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_a_probe_defined_in_a_test_gives_its_verdict_summary_advice_and_json(log_zeros_probe, log_zero_step):
    # logits (200, 0, -200): softmax's p(class 2) is exactly 0 in FP32, so the loss's log reads one zero
    out = _json("replay", str(log_zero_step), "--device", "cpu")
    assert out["verdict"] == "log_of_zeros_test" and out["culprit"]["op"] == "aten.log"
    zeros = out["log_zeros"]["zeros"]
    assert zeros >= 1 and out["log_zeros"]["numel"] >= zeros
    assert out["summary"] == (f"aten.log in `{out['culprit']['module']}` read {zeros} exact zero(s). "
                              f"The log read {zeros} exact zero(s) among {out['log_zeros']['numel']} value(s).")
    assert out["advice"] == [f"Clamp the {zeros} zero(s) away before the log."]


def test_the_probes_verdict_heads_the_autopsy_json_and_its_text_answer(log_zeros_probe, log_zero_step):
    run_dir = log_zero_step.parent.parent
    out = _json("autopsy", str(run_dir), "--device", "cpu")
    assert out["verdict"] == "log_of_zeros_test" and out["replays"][0]["log_zeros"]["zeros"] >= 1
    assert out["answer"][0].startswith("root cause: log_of_zeros_test: aten.log in ")
    text = CliRunner().invoke(main, ["autopsy", str(run_dir), "--device", "cpu"]).output
    assert "verdict: log_of_zeros_test" in text and "exact zero(s) among" in text


def test_without_the_probes_module_the_same_step_is_a_numerical_bug_with_no_log_zeros(log_zero_step):
    assert "log_zeros" not in PROBES
    out = _json("replay", str(log_zero_step), "--device", "cpu")
    assert out["verdict"] == "numerical_bug" and "log_zeros" not in out

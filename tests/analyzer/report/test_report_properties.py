"""Property-based tests: ``analyzer report --json`` on generated run directories never breaks.

The traces come from ``report_traces``: written by the Recorder's own ``TraceWriter``, with NaN,
+-Inf and null in every column (at step 0, at the last step, on every step, sprinkled), single-step
runs, runs without a GradScaler or with a scale that fell below 1, layer rows every N steps,
parameters that never get a gradient, and ranks of different lengths.
"""
from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings

from analyzer.report.checks import CHECK_FAILED, CHECKS
from analyzer.cli import main
from analyzer.findings import SEVERITIES

from .report_traces import every_column, healthy_traces, hostile_traces, write_trace

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

_SETTINGS = settings(max_examples=40, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow])
_FINDING_KEYS = {"check", "severity", "step", "rank", "message", "evidence"}


def _refuse(const):  # json.loads accepts NaN/Infinity literals by default; strict JSON has none
    raise AssertionError(f"non-strict JSON literal {const}")


def _report_json(spec, *args) -> dict:
    with tempfile.TemporaryDirectory() as d:
        run = write_trace(spec, Path(d) / "run")
        res = CliRunner().invoke(main, ["report", str(run), "--json", *args])
    assert res.exit_code == 0, (spec, res.output)
    assert "RuntimeWarning" not in res.stderr, (spec, res.stderr)  # no NaN arithmetic slips through
    return json.loads(res.stdout, parse_constant=_refuse)


@_SETTINGS
@given(hostile_traces())
@example(every_column("all"))                       # NaN, Inf or null in every column, every step
@example(every_column("null", amp_dtype=None, scaler=False))
@example(every_column("first", lengths=(1,)))      # a single step, broken
@example(every_column("last", amp_dtype="bfloat16", scaler=False, lengths=(5, 40, 1)))
@example(every_column("sprinkled", lengths=(70, 3), n_layers=1))
# an FP16 run whose first step was skipped and whose last scale is NaN/Inf: the start-up
# calibration's backoff count once subtracted inf - inf (a RuntimeWarning); found by hypothesis
@example(dataclasses.replace(every_column("ok", lengths=(7, 1), n_layers=0), scaler=False, seed=5669,
                             scale_floor=65536.0, healthy=False,
                             patterns={**every_column("ok").patterns, "scale": "last", "skipped": "first"}))
def test_report_json_on_any_generated_trace_exits_0_with_strict_json_and_complete_findings(spec):
    obj = _report_json(spec)
    assert obj["steps"]["count"] >= 1 and isinstance(obj["verdict"], str)
    for f in obj["findings"]:
        assert set(f) == _FINDING_KEYS, f
        assert f["check"] in CHECKS and f["check"] != CHECK_FAILED, f  # no check raised
        assert f["severity"] in SEVERITIES and isinstance(f["message"], str) and f["message"]
        assert f["step"] is None or isinstance(f["step"], int)
        assert isinstance(f["evidence"], dict)


@settings(max_examples=20, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_traces())
def test_report_of_one_rank_of_any_generated_trace_exits_0(spec):
    obj = _report_json(spec, "--rank", "0")
    assert obj["rank"] == 0 and all(f["check"] != CHECK_FAILED for f in obj["findings"])


@_SETTINGS
@given(healthy_traces())
def test_healthy_generated_traces_have_no_errors_or_warnings(spec):
    obj = _report_json(spec)
    flagged = [f["message"] for f in obj["findings"] if f["severity"] != "info"]
    assert not flagged, (spec, flagged)
    assert obj["verdict"].startswith("healthy")


@pytest.mark.slow  # matplotlib: ~1-5 s per example on a busy 2-core machine
@settings(max_examples=4, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_traces())
def test_plots_and_html_render_for_any_generated_trace(spec):
    with tempfile.TemporaryDirectory() as d:
        run = write_trace(spec, Path(d) / "run")
        res = CliRunner().invoke(main, ["report", str(run), "--plots", str(Path(d) / "p"),
                                        "--html", str(Path(d) / "r.html")])
        assert res.exit_code == 0, (spec, res.output)
        assert (Path(d) / "p" / "loss_scale.png").stat().st_size > 0
        assert "<h1>amp-autopsy report" in (Path(d) / "r.html").read_text()

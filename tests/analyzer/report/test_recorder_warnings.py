"""``analyzer report`` repeats the RecorderWarnings kept in meta.json: ``scaled_loss`` from the recorder's own
warning where the trace test misses it, ``recorder_warning`` for the others, older runs as before, and
hostile ``warnings`` entries never a traceback."""
from __future__ import annotations

import json
import re
import shutil

import polars as pl
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.cli import main
from analyzer.load import load_run
from analyzer.report.checks import build_frames
from analyzer.report.checks.mistakes import _scaled_by_trace
from tests.recorders.test_warnings_kept import noisy_scaled_loop


@pytest.fixture(scope="module")
def scaled_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("scaled") / "run"
    noisy_scaled_loop(run)
    return run


def _report(run, *args):
    return CliRunner().invoke(main, ["report", str(run), *args])


def test_a_noisy_scaled_loss_gets_scaled_loss_from_the_kept_warning_every_time(scaled_run):
    # the trace test misses it: the noisy loss does not follow the scale's changes
    assert _scaled_by_trace(build_frames(load_run(scaled_run))) == []
    for _ in range(2):  # every report, not the first only
        result = _report(scaled_run, "--json")
        assert result.exit_code == 0, result.output
        [f] = [f for f in json.loads(result.output)["findings"] if f["check"] == "scaled_loss"]
        assert (f["severity"], f["step"]) == ("warning", 0)
        assert f["evidence"] == {"source": "recorder_warning", "warned_step": 0, "rank": 0}
        assert f["message"].startswith("during training the recorder warned at step 0 that end_step was given the "
                                       "scaled loss (loss x the GradScaler's scale, ")
        assert "the loss values in this report are scaled" in f["message"]


def test_the_last_finite_loss_is_printed_unscaled_when_the_loss_was_recorded_scaled(scaled_run):
    steps = pl.concat([pl.read_parquet(p) for p in sorted((scaled_run / "trace").glob("steps-*.parquet"))])
    last = steps.filter(pl.col("loss").is_finite()).sort("step").row(-1, named=True)
    result = _report(scaled_run)
    assert result.exit_code == 0, result.output
    m = re.search(r"last finite loss (\S+) \(recorded (\S+) = loss x scale: scaled_loss\)", result.output)
    assert m, result.output
    # the recorded value is loss x the scale of its step: divided back, it is the loss the loop computed
    assert float(m[1]) == pytest.approx(last["loss"] / last["scale"], rel=1e-3)
    assert float(m[2]) == pytest.approx(last["loss"], rel=1e-3)
    summary = json.loads(_report(scaled_run, "--json").output)["steps"]
    assert summary["loss_scaled"] is True and summary["last_finite_loss"] == last["loss"]


def test_an_older_run_without_kept_warnings_reports_as_before(scaled_run, tmp_path):
    run = tmp_path / "old"
    shutil.copytree(scaled_run, run)
    meta = json.loads((run / "meta.json").read_text())
    del meta["warnings"]
    meta["format_version"] = 6
    (run / "meta.json").write_text(json.dumps(meta))
    result = _report(run, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert not [f for f in out["findings"] if f["check"] in ("scaled_loss", "recorder_warning")]
    assert out["steps"]["loss_scaled"] is False
    assert "(recorded" not in _report(run).output


def test_another_kept_warning_is_a_recorder_warning_finding_naming_its_kind(scaled_run, tmp_path):
    run = tmp_path / "w"
    shutil.copytree(scaled_run, run)
    meta = json.loads((run / "meta.json").read_text())
    meta["warnings"].append({"kind": "write_error", "step": 7, "message": "amp-autopsy recorder could not "
                             "write a trace part in run: OSError: [Errno 28] No space left on device."})
    (run / "meta.json").write_text(json.dumps(meta))
    result = _report(run, "--json")
    assert result.exit_code == 0, result.output
    [f] = [f for f in json.loads(result.output)["findings"] if f["check"] == "recorder_warning"]
    assert (f["severity"], f["step"], f["evidence"]["kind"]) == ("warning", 7, "write_error")
    assert f["message"].startswith("during training the recorder warned (write_error): amp-autopsy recorder could "
                                   "not write a trace part")
    assert "recorder_warning @ step 7: during training the recorder warned (write_error)" in _report(run).output


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                     max_leaves=12)
_entry = st.fixed_dictionaries({}, optional={"kind": _json | st.sampled_from(["scaled_loss", "stopped", "x\x1b[2J"]),
                                             "step": _json, "message": _json | st.text(max_size=60)})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(warnings_entry=st.one_of(_json, st.lists(_entry | _json, max_size=40)))
def test_any_warnings_entry_gives_a_report_or_one_error_line(scaled_run, tmp_path_factory, warnings_entry):
    run = tmp_path_factory.mktemp("h") / "run"
    shutil.copytree(scaled_run, run)
    meta = json.loads((run / "meta.json").read_text())
    meta["warnings"] = warnings_entry
    (run / "meta.json").write_text(json.dumps(meta))
    result = _report(run)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert result.exit_code == 0 or result.output.startswith("Error: "), result.output
    assert "\x1b" not in result.output

"""``analyzer autopsy`` on a small real run: the answer first, strict JSON that embeds the report and
replay objects unchanged, output files, and bad input as one ``Error:`` line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.cli import main
from recorders import schema

from .autopsy_runs import INF_STEP


def _refuse_constant(name: str):
    raise ValueError(f"non-strict JSON constant {name}")


def _strict(text: str) -> dict:
    return json.loads(text, parse_constant=_refuse_constant)


def _invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def run_dir(inf_target_run) -> Path:
    return inf_target_run  # shared with test_autopsy_hostile.py (tests/analyzer/conftest.py); tests copy before writing


@pytest.fixture(scope="module")
def as_json(run_dir) -> dict:
    res = _invoke("autopsy", str(run_dir), "--json", "--device", "cpu")
    assert res.exit_code == 0, res.output
    return _strict(res.stdout)


def _snapshot(run_dir: Path) -> Path:
    return run_dir / schema.SNAPSHOT_DIR / schema.snapshot_name(INF_STEP, 0, "nonfinite_loss")


def test_the_text_starts_with_the_answer_naming_the_inf_in_the_batch_and_then_the_evidence(run_dir):
    res = _invoke("autopsy", str(run_dir), "--device", "cpu")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[:3] == [f"amp-autopsy autopsy: {run_dir}", "verdict: nonfinite_input", "answer:"]
    assert lines[3].startswith("  root cause: nonfinite_input: ")
    assert "batch:" in lines[3]  # the inf sits in the batch's target, not in the model
    text = res.stdout
    assert text.index("answer:") < text.index(f"evidence 1/2: analyzer report {run_dir}") \
        < text.index(f"evidence 2/2: analyzer replay {_snapshot(run_dir)}")
    assert "what to try:" not in text  # the replay's untried list is replaced by the answer's statuses


def test_json_is_strict_and_its_report_and_replay_equal_the_standalone_commands(run_dir, as_json):
    report = _invoke("report", str(run_dir), "--json")
    replay = _invoke("replay", str(_snapshot(run_dir)), "--json", "--device", "cpu")
    assert report.exit_code == 0 and replay.exit_code == 0, report.output + replay.output
    assert as_json["report"] == _strict(report.stdout)
    assert as_json["replays"] == [_strict(replay.stdout)]
    assert as_json["autopsy_version"] == 1 and as_json["run"] == str(run_dir)
    assert as_json["verdict"] == as_json["replays"][0]["verdict"] == "nonfinite_input"
    assert as_json["culprit"] == as_json["replays"][0]["culprit"]
    assert as_json["answer"] and as_json["answer"][0].startswith("root cause: nonfinite_input")
    assert all(f["snapshot"] == str(_snapshot(run_dir)) for f in as_json["fixes"] + as_json["advice"])
    assert as_json["errors"] == []


def test_nonfinite_input_tries_no_fix(as_json):
    # A non-finite input is not the model's fault: no fix applies; the answer names the input to look at.
    assert all(f["status"] == "not_tried" for f in as_json["fixes"])


def test_out_writes_the_report_plots_and_the_replay_figure(run_dir, tmp_path):
    out = tmp_path / "figs"
    res = _invoke("autopsy", str(run_dir), "--out", str(out), "--device", "cpu")
    assert res.exit_code == 0, res.output
    replay_png = out / f"{_snapshot(run_dir).stem}-replay.png"
    for png in (out / "loss_scale.png", replay_png):
        assert png.stat().st_size > 1000 and f"plot: {png}" in res.stdout


def test_out_inside_the_run_directory_is_refused_before_anything_runs(run_dir):
    before = sorted(p.name for p in (run_dir / schema.SNAPSHOT_DIR).iterdir())
    res = _invoke("autopsy", str(run_dir), "--out", str(run_dir / schema.SNAPSHOT_DIR / "figs"))
    assert res.exit_code == 1 and res.stdout == ""
    assert res.stderr.startswith("Error: ") and len(res.stderr.splitlines()) == 1 and "--out" in res.stderr
    assert sorted(p.name for p in (run_dir / schema.SNAPSHOT_DIR).iterdir()) == before


def test_a_missing_run_is_one_error_line_and_exit_1(tmp_path):
    res = _invoke("autopsy", str(tmp_path / "nope"))
    assert res.exit_code == 1 and res.stdout == ""
    assert res.stderr.startswith(f"Error: {tmp_path / 'nope'}: no such file or directory")
    assert len(res.stderr.splitlines()) == 1 and "Traceback" not in res.output


def test_an_unimportable_factory_keeps_the_report_and_names_the_snapshot_in_one_error_line(run_dir):
    res = _invoke("autopsy", str(run_dir), "--factory", "no_such_package_xyz.models:build", "--device", "cpu")
    assert res.exit_code == 1
    assert f"amp-autopsy report: {run_dir}" in res.stdout  # the report is not lost
    assert f"could not replay {_snapshot(run_dir)}" in res.stdout
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "no_such_package_xyz" in errors[0] and "Traceback" not in res.output


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=4096))
def test_a_corrupt_snapshot_is_one_error_line_naming_it_and_the_report_is_kept(run_dir, tmp_path_factory, junk):
    copy = Path(shutil.copytree(run_dir, tmp_path_factory.mktemp("corrupt") / "run"))
    snap = _snapshot(copy)
    snap.write_bytes(junk)  # our own copy: the recorded run is never touched
    res = _invoke("autopsy", str(copy), "--json", "--device", "cpu")
    assert res.exit_code == 1, res.output
    assert res.stderr.startswith(f"Error: {snap}") and len(res.stderr.splitlines()) == 1
    assert "Traceback" not in res.output
    out = _strict(res.stdout)
    assert out["verdict"] == "no_snapshot" and out["replays"] == [] and out["report"]["run"] == str(copy)
    assert [e["snapshot"] for e in out["errors"]] == [str(snap)]


def test_html_writes_the_autopsy_page_with_the_verdict_and_a_relative_snapshot_link(run_dir, tmp_path):
    page = tmp_path / "autopsy.html"
    res = _invoke("autopsy", str(run_dir), "--html", str(page), "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert f"html: {page}" in res.stdout
    text = page.read_text()
    assert "nonfinite_input" in text and _snapshot(run_dir).name in text and "file://" not in text


def test_html_onto_the_runs_meta_json_is_refused_and_leaves_it_alone(run_dir):
    meta = run_dir / schema.META_FILE
    before = meta.read_bytes()
    res = _invoke("autopsy", str(run_dir), "--html", str(meta))
    assert res.exit_code == 1 and res.stderr.startswith("Error: ") and "--html" in res.stderr
    assert meta.read_bytes() == before


def test_fail_on_error_exits_4_after_printing_the_autopsy_as_report_does(run_dir):
    # the report's nonfinite_loss at INF_STEP is an error finding: --fail-on error gates on it
    res = _invoke("autopsy", str(run_dir), "--fail-on", "error", "--device", "cpu")
    assert res.exit_code == 4 and res.stdout.startswith(f"amp-autopsy autopsy: {run_dir}\nverdict: nonfinite_input")
    assert "Error:" not in res.output

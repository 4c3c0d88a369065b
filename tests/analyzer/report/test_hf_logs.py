"""``analyzer report`` on HF Trainer output: its output directory, its trainer_state.json, and the
step numbers the recorder, the autopsy and HF itself agree on (real Trainer runs, tests/hf_runs.py)."""
from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from analyzer.cli import main
from tests.hf_runs import first_nonfinite_grad_step


def _report_json(path) -> dict:
    res = CliRunner().invoke(main, ["report", str(path), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def _first_error(rep: dict) -> dict:
    return next(f for f in rep["findings"] if f["severity"] == "error")


def _first_nonfinite(rep: dict) -> dict:
    # the recorder's trace also has the weights' norms, so weights_exploded comes first there (its update
    # precedes the NaN): the NaN gradients are the first non-finite finding
    return next(f for f in rep["findings"] if f["severity"] == "error" and f["check"].startswith("nonfinite"))


def test_report_on_hfs_own_output_dir_finds_the_nan_gradient_step(hf_plain_run):
    out = hf_plain_run["out_dir"]
    assert not (out / "meta.json").exists() and sorted(p.name for p in out.iterdir()) == ["checkpoint-3", "checkpoint-6"]
    rep = _report_json(out)
    f = _first_error(rep)
    assert f["check"] == "nonfinite_grads" and f["step"] == first_nonfinite_grad_step(hf_plain_run)
    assert not rep["verdict"].startswith("healthy")
    # HF's logging_nan_inf_filter logged a stand-in loss there: it is marked, never called finite
    assert f["evidence"]["loss_filtered"] is True and f["evidence"]["loss"] is None
    assert "stayed finite" not in f["message"]


def test_the_report_reads_the_newest_checkpoint_state_of_the_output_dir(hf_plain_run):
    rep = _report_json(hf_plain_run["out_dir"])
    assert rep["run"] == str(hf_plain_run["out_dir"])
    steps = rep["steps"]
    assert (steps["first"], steps["last"]) == (1, 6)  # checkpoint-6's history, not checkpoint-3's


def test_the_newest_state_is_the_highest_global_step_not_the_last_name(tmp_path):
    # checkpoint-10 sorts before checkpoint-9 by name; only checkpoint-10's history has the NaN step
    for n in (9, 10):
        d = tmp_path / f"checkpoint-{n}"
        d.mkdir()
        history = [{"loss": 2.0, "grad_norm": 1.0, "learning_rate": 1e-3, "step": s} for s in range(1, n + 1)]
        if n == 10:
            history[-1]["grad_norm"] = float("nan")
        (d / "trainer_state.json").write_text(json.dumps({"global_step": n, "log_history": history}))
    f = _first_error(_report_json(tmp_path))
    assert (f["check"], f["step"]) == ("nonfinite_grads", 10)


def test_nan_grad_norms_beside_filtered_losses_are_not_a_healthy_run(tmp_path):
    # 29 steps of grad_norm NaN whose losses HF's filter replaced by the running mean
    history = [{"loss": 2.0, "grad_norm": 1.0 if s < 12 else float("nan"), "step": s} for s in range(1, 41)]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 40, "log_history": history}))
    rep = _report_json(tmp_path / "trainer_state.json")
    assert rep["verdict"].startswith("FAILED")
    f = _first_error(rep)
    assert (f["check"], f["step"]) == ("nonfinite_grads", 12)
    # the log says nothing about the precision: no range claim either way
    assert "in FP32" not in f["message"] and "not a range issue" not in f["message"]


def test_an_hf_output_dir_without_trainer_state_says_how_to_get_one(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "model.safetensors").write_bytes(b"")
    res = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert res.exit_code == 1
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("Error:") and "trainer_state.json" in line and "save_state" in line


@pytest.mark.slow
def test_the_first_nan_gradient_step_is_one_number_in_report_autopsy_and_trainer_state(hf_blowup_run):
    from analyzer.autopsy import run_autopsy

    hf_step = first_nonfinite_grad_step(hf_blowup_run)
    state = json.loads((hf_blowup_run["out_dir"] / "checkpoint-6" / "trainer_state.json").read_text())
    in_state = next(e["step"] for e in state["log_history"] if "grad_norm" in e and not math.isfinite(e["grad_norm"]))
    assert in_state == hf_step
    rep = _report_json(hf_blowup_run["run_dir"])
    assert _first_nonfinite(rep)["step"] == hf_step
    result = run_autopsy(hf_blowup_run["run_dir"], device="cpu")
    assert result.primary is not None and result.primary.step == hf_step
    assert result.primary.verdict != "healthy"


def test_hfs_log_and_the_recorders_trace_of_one_run_report_the_same_failing_step(hf_blowup_run):
    from_log = _first_error(_report_json(hf_blowup_run["out_dir"]))
    from_trace = _first_nonfinite(_report_json(hf_blowup_run["run_dir"]))
    assert from_log["step"] == from_trace["step"] == first_nonfinite_grad_step(hf_blowup_run)
    assert from_log["check"] == from_trace["check"] == "nonfinite_grads"

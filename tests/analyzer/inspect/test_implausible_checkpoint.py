"""``inspect`` of a checkpoint or snapshot holding a GradScaler scale or a step no training run
saves: ``implausible_checkpoint`` names the file, the field and the value; nothing is dropped in silence."""
from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main
from recorders import schema


def _inspect(path) -> tuple[dict, str]:
    runner = CliRunner()
    res = runner.invoke(main, ["inspect", str(path), "--json"])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    text = runner.invoke(main, ["inspect", str(path)])
    assert text.exit_code == 0, text.output
    return json.loads(res.stdout), text.stdout


def _finding(out: dict) -> dict | None:
    found = [f for f in out["findings"] if f["check"] == "implausible_checkpoint"]
    assert len(found) <= 1
    return found[0] if found else None


@pytest.mark.parametrize("scale, shown", [
    ("big", "'big'"), (None, "None"), (math.nan, "nan"), (math.inf, "inf"), (-2.0, "-2.0"),
    (torch.ones(3), "a float32 tensor of shape [3]"), (torch.tensor(math.nan), "a float32 tensor of shape []"),
])
def test_a_scaler_scale_that_is_not_a_scale_is_named_not_dropped(tmp_path, scale, shown):
    torch.save({"model": {"w": torch.ones(2)}, "scaler": {"scale": scale, "_growth_tracker": 0}}, tmp_path / "c.pt")
    out, text = _inspect(tmp_path / "c.pt")
    f = _finding(out)
    assert f is not None and f["severity"] == "warning", out["findings"]
    assert f["evidence"]["values"] == [f"scaler.scale {shown} is not a GradScaler scale (a finite number >= 0); "
                                       "the scale is not reported"]
    assert out["files"][0]["scaler"] is None and "scaler scale" not in text
    assert "findings: none" not in text and "implausible_checkpoint" in text


@pytest.mark.parametrize("step, shown", [(math.nan, "nan"), (2**100, str(2**100)), ("ten", "'ten'"), (-3, "-3"),
                                         (True, "True")])
def test_a_step_that_is_not_a_step_number_is_named_and_not_printed(tmp_path, step, shown):
    torch.save({"model": {"w": torch.ones(2)}, "global_step": step}, tmp_path / "c.pt")
    out, text = _inspect(tmp_path / "c.pt")
    assert _finding(out)["evidence"]["values"] == [
        f"global_step {shown} is not a step number (a whole number from 0 to 2**63)"]
    assert out["files"][0]["step"] is None and ", step " not in text.splitlines()[0]


@pytest.mark.parametrize("step", [torch.tensor(100), 100.0, 100])
def test_real_step_counters_are_read_without_a_finding(tmp_path, step):
    torch.save({"model": {"w": torch.ones(2)}, "global_step": step, "epoch": 2.5}, tmp_path / "c.pt")
    out, _ = _inspect(tmp_path / "c.pt")
    assert out["files"][0]["step"] == 100 and _finding(out) is None


def test_a_scale_of_zero_is_a_real_collapse_not_an_implausible_value(tmp_path):
    torch.save({"model": {"w": torch.ones(2)}, "scaler": {"scale": 0.0, "_growth_tracker": 0}}, tmp_path / "c.pt")
    out, _ = _inspect(tmp_path / "c.pt")
    assert out["files"][0]["scaler"]["scale"] == 0.0 and _finding(out) is None


@pytest.mark.parametrize("step, shown", [(math.nan, "nan"), ("ten", "'ten'"), (2**100, str(2**100))])
def test_a_snapshot_whose_step_is_not_a_step_number_is_named(tmp_path, step, shown):
    snap = {"format": schema.SNAPSHOT_FORMAT, "format_version": schema.FORMAT_VERSION, "step": step,
            "model_state": {"w": torch.ones(2)}, "batch": None, "scale": 1024.0}
    torch.save(snap, tmp_path / "s.pt")
    out, _ = _inspect(tmp_path / "s.pt")
    assert _finding(out)["evidence"]["values"] == [
        f"step {shown} is not a step number (a whole number from 0 to 2**63)"]
    assert out["files"][0]["scaler"]["scale"] == 1024.0

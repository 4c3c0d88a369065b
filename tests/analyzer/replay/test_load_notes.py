"""What loading a snapshot found implausible but usable (``Snapshot.load_notes``) is said before the verdict."""
from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from analyzer.cli import main
from recorders.snapshot import write_snapshot

from . import replay_models as rm


def test_a_loss_scale_of_2_to_the_100_is_named_before_the_verdict_in_text_and_json(tmp_path):
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 1, generator=g)}
    path = rm.record_step(tmp_path / "run", factory="build_mlp", loss_fn="mse", batch=batch,
                          amp_dtype=torch.float16, init_scale=1024.0, manual=True)
    snap = torch.load(path, weights_only=True)
    snap["scale"] = 2.0 ** 100  # no GradScaler gets there: every FP16 gradient is inf at that scale
    write_snapshot(path, snap)
    text = CliRunner().invoke(main, ["replay", str(path), "--device", "cpu"]).output.splitlines()
    assert text[0].startswith("NB: the recorded loss scale 1.27e+30 is beyond any an FP16 backward survives")
    assert text[1].startswith("verdict: ")
    out = json.loads(CliRunner().invoke(main, ["replay", str(path), "--device", "cpu", "--json"]).output)
    assert len(out["load_notes"]) == 1 and out["load_notes"][0] == text[0].removeprefix("NB: ")


def test_a_recorded_snapshot_has_no_load_notes_key(tmp_path):
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 1, generator=g)}
    path = rm.record_step(tmp_path / "run", factory="build_mlp", loss_fn="mse", batch=batch, amp_dtype=None,
                          manual=True)
    out = json.loads(CliRunner().invoke(main, ["replay", str(path), "--device", "cpu", "--json"]).output)
    assert "load_notes" not in out and out["verdict"] == "healthy"

"""``load.target.open_target``: what replay and autopsy were given, opened into a ``Target``."""
from __future__ import annotations

import pytest
import torch

from analyzer.errors import BadInputError
from analyzer.load.snapshot import Snapshot
from analyzer.load.target import open_target
from recorders import schema

from ..replay import replay_models as rm


def test_a_run_directory_or_its_meta_json_is_a_run_whose_files_are_in_that_directory(tmp_path):
    (tmp_path / "meta.json").write_text("{}")
    for named in (tmp_path, tmp_path / "meta.json"):
        target = open_target(named, command="autopsy")
        assert (target.kind, target.source, target.run_dir) == ("run", str(named), tmp_path)


def test_replay_without_a_batch_takes_the_path_as_a_snapshot_and_refuses_a_checkpoint(tmp_path):
    snap = tmp_path / "step00000001-r00000-nonfinite_loss.pt"
    torch.save({"format": schema.SNAPSHOT_FORMAT}, snap)  # the rest is the replay's to read
    assert open_target(snap, command="replay").kind == "snapshot"
    ckpt = tmp_path / "last.ckpt"
    torch.save(rm.build_mlp().state_dict(), ckpt)
    with pytest.raises(BadInputError, match="a Lightning checkpoint.*--batch"):
        open_target(ckpt, command="replay")


@pytest.mark.parametrize("command", ["replay", "autopsy"])
def test_a_checkpoint_with_its_batch_opens_as_the_snapshot_replay_consumes(tmp_path, command):
    ckpt, batch = tmp_path / "model.pt", tmp_path / "batch.pt"
    torch.save(rm.build_mlp().state_dict(), ckpt)
    torch.save({"x": torch.ones(2, 4), "y": torch.zeros(2, 1)}, batch)
    target = open_target(ckpt, command=command, batch=str(batch), amp="bf16", factory=f"{rm.REF}:build_mlp",
                         loss_fn=f"{rm.REF}:mse")
    assert target.kind == "checkpoint" and target.run_dir == tmp_path and target.named == str(ckpt)
    assert isinstance(target.source, Snapshot) and target.source.amp_dtype == "bfloat16"

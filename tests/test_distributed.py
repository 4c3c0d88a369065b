"""Two real processes over gloo on CPU, a Recorder in each rank: the one distributed test file.

One spawn trains every run in the same process group, to keep the file under ~30 s on a small
machine: DDP with FP16 autocast and a NaN in rank 1's batch, ``plain`` (default) and ``synced``
(``sync_failures=True``); then an unwrapped FP32 MLP per rank with an inf in rank 1's target,
``unwrapped`` and ``unwrapped_synced`` (``dist_worker.train_unwrapped``).
"""
from __future__ import annotations

import json
import math
import socket

import polars as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from click.testing import CliRunner

from analyzer.load import load_snapshot
from recorders import schema

from . import dist_worker

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

WORLD, STEPS, NAN_RANK, NAN_STEP = 2, 4, 1, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    plain, synced = root / "plain", root / "synced"
    # NB: spawn, not fork: forked children hung in gloo after other tests had run in the parent.
    mp.spawn(dist_worker.train_rank,
             args=(WORLD, _free_port(), {str(plain): False, str(synced): True}, STEPS, NAN_RANK, NAN_STEP,
                   {str(root / "unwrapped"): False, str(root / "unwrapped_synced"): True}),
             nprocs=WORLD, join=True)
    return plain, synced


def _snapshots(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / schema.SNAPSHOT_DIR).glob(schema.SNAPSHOT_GLOB))


def test_each_rank_writes_its_own_meta_and_trace_parts_with_the_rank_in_names_and_rows(runs):
    plain, _ = runs
    for rank in range(WORLD):
        meta = json.loads((plain / schema.meta_name(rank)).read_text())
        assert (meta["rank"], meta["world_size"]) == (rank, WORLD)
        parts = sorted((plain / schema.TRACE_DIR).glob(f"steps-r{rank:05d}-p*.parquet"))
        assert parts, f"rank {rank} wrote no step parts"
        steps = pl.read_parquet(parts)
        assert steps["rank"].unique().to_list() == [rank]
        assert sorted(steps["step"].to_list()) == list(range(STEPS))
        layers = pl.read_parquet(sorted((plain / schema.TRACE_DIR).glob(f"layers-r{rank:05d}-p*.parquet")))
        assert layers["rank"].unique().to_list() == [rank]


def test_only_the_rank_whose_batch_holds_the_nan_has_a_nonfinite_loss(runs):
    plain, _ = runs
    steps = pl.read_parquet(plain / schema.TRACE_DIR / schema.STEPS_GLOB).sort("rank", "step")
    loss = {(r, s): v for r, s, v in steps.select("rank", "step", "loss").iter_rows()}
    assert math.isnan(loss[(NAN_RANK, NAN_STEP)])
    assert all(math.isfinite(v) for k, v in loss.items() if k != (NAN_RANK, NAN_STEP))
    # DDP averages the NaN gradient into every rank, so every rank's GradScaler skips that step.
    skipped = steps.filter(pl.col("step") == NAN_STEP)["skipped"].to_list()
    assert skipped == [True] * WORLD


def test_without_sync_failures_only_the_nan_rank_snapshots_its_batch(runs):
    plain, _ = runs
    # Rank 0 only sees a skipped step (overflow), which is not a failure on its own.
    assert _snapshots(plain) == [schema.snapshot_name(NAN_STEP, NAN_RANK, "nonfinite_loss")]
    snap = torch.load(plain / schema.SNAPSHOT_DIR / _snapshots(plain)[0], weights_only=True)
    assert (snap["rank"], snap["world_size"], snap["step"]) == (NAN_RANK, WORLD, NAN_STEP)
    assert torch.isnan(snap["batch"]["x"][1, 2])
    assert list(snap["model_state"])[0] == "0.weight"  # the module inside DDP, no "module." prefix


def test_with_sync_failures_every_rank_snapshots_the_same_step(runs):
    _, synced = runs
    assert _snapshots(synced) == [
        schema.snapshot_name(NAN_STEP, 0, "peer_failure"),
        schema.snapshot_name(NAN_STEP, NAN_RANK, "nonfinite_loss"),
    ]
    snap0 = torch.load(synced / schema.SNAPSHOT_DIR / _snapshots(synced)[0], weights_only=True)
    # Rank 0's own batch of that step, finite, replayable on its own.
    expected = dist_worker.batch_for(0, NAN_STEP, nan_rank=NAN_RANK, nan_step=NAN_STEP)
    assert torch.equal(snap0["batch"]["x"], expected["x"])


def test_the_report_names_rank_1_and_the_step_its_loss_went_nan(runs):
    from analyzer.report import build_report

    plain, _ = runs
    rep = build_report(str(plain)).to_dict()
    div = [f for f in rep["findings"] if f["check"] == "rank_divergence" and f["severity"] == "error"]
    assert div, f"no rank_divergence error in {[f['check'] for f in rep['findings']]}"
    assert (div[0]["rank"], div[0]["step"]) == (NAN_RANK, NAN_STEP)
    assert f"rank {NAN_RANK}" in div[0]["message"] and f"step {NAN_STEP}" in div[0]["message"]


def test_the_report_cli_merges_both_ranks_and_narrows_to_one_with_rank(runs):
    from analyzer.cli import main

    plain, _ = runs
    merged = CliRunner().invoke(main, ["report", str(plain), "--json"])
    assert merged.exit_code == 0, merged.output
    assert sorted(r["rank"] for r in json.loads(merged.output)["ranks"]) == [0, 1]
    one = CliRunner().invoke(main, ["report", str(plain), "--rank", "0", "--json"])
    assert one.exit_code == 0, one.output
    out = json.loads(one.output)
    assert out["rank"] == 0
    assert not [f for f in out["findings"] if f["check"] == "nonfinite_loss"]  # rank 0 stayed finite
    text = CliRunner().invoke(main, ["report", str(plain)])
    assert text.exit_code == 0 and f"rank {NAN_RANK}" in text.output


def test_replay_of_rank_1s_snapshot_blames_the_nan_in_its_batch(runs):
    from analyzer.replay import replay_snapshot

    plain, _ = runs
    path = plain / schema.SNAPSHOT_DIR / schema.snapshot_name(NAN_STEP, NAN_RANK, "nonfinite_loss")
    result = replay_snapshot(str(path), device="cpu").to_dict()
    assert result["verdict"] == "nonfinite_input"
    assert result["culprit"]["input"] == "batch:x"


def test_replay_of_rank_0s_synced_snapshot_is_healthy(runs):
    from analyzer.replay import replay_snapshot

    _, synced = runs
    path = synced / schema.SNAPSHOT_DIR / schema.snapshot_name(NAN_STEP, 0, "peer_failure")
    # Rank 0's local forward and backward were finite: the NaN came in through the all-reduce.
    assert replay_snapshot(str(path), device="cpu").to_dict()["verdict"] == "healthy"


# ---------------------------------------------------------------- unwrapped runs: no DDP, no scaler
def test_each_rank_of_an_unwrapped_run_writes_its_own_meta_parts_and_rows(runs):
    run = runs[0].parent / "unwrapped"
    assert json.loads((run / "meta.json").read_text())["rank"] == 0
    meta1 = json.loads((run / schema.meta_name(1)).read_text())
    assert (meta1["rank"], meta1["world_size"]) == (1, 2)
    assert sorted(p.name for p in (run / "trace").glob(schema.STEPS_GLOB)) == [
        schema.part_name("steps", 0, 0), schema.part_name("steps", 1, 0), schema.part_name("steps", 1, 1)]
    steps = pl.read_parquet(run / "trace" / schema.STEPS_GLOB)
    assert steps.group_by("rank").len().sort("rank").rows() == [(0, 4), (1, 4)]
    layers = pl.read_parquet(run / "trace" / schema.LAYERS_GLOB)
    assert sorted(layers["rank"].unique().to_list()) == [0, 1]


def test_without_sync_failures_only_the_failing_unwrapped_rank_snapshots(runs):
    assert _snapshots(runs[0].parent / "unwrapped") == [schema.snapshot_name(2, 1, "nonfinite_loss")]


def test_with_sync_failures_every_unwrapped_rank_snapshots_the_failing_step_and_it_loads(runs):
    synced = runs[0].parent / "unwrapped_synced"
    names = _snapshots(synced)
    # rank 1 stays NaN after step 2 (SGD applied its NaN gradients): one stretch, one snapshot each
    assert names == [schema.snapshot_name(2, 0, "peer_failure"), schema.snapshot_name(2, 1, "nonfinite_loss")]
    snap = load_snapshot(synced / schema.SNAPSHOT_DIR / names[0])
    assert (snap["rank"], snap["world_size"], snap["step"]) == (0, 2, 2)

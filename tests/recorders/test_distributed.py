"""Two real gloo ranks on CPU: per-rank files and rows, and sync_failures."""
from __future__ import annotations

import json
import os
import sys
import time

import polars as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from analyzer.load import load_snapshot
from recorders import Recorder, schema
from tests.recorders.models import batches, build_mlp, train

pytestmark = pytest.mark.skipif(not dist.is_available() or sys.platform == "win32",
                                reason="needs torch.distributed with gloo")


def _worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    try:
        for sync in (False, True):
            model = build_mlp()
            data = batches(4, seed=rank + 1)
            if rank == 1:
                data[2]["y"][0, 0] = float("inf")  # only rank 1 fails, at step 2
            with Recorder(os.path.join(tmp, f"sync{sync}"), model, factory="tests.recorders.models:build_mlp",
                          loss_fn="tests.recorders.models:mse_loss", sync_failures=sync) as rec:
                train(model, data, rec=rec)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    # NB: spawn, not fork: forked children hung in gloo after other tests had run in the parent.
    ctx = mp.spawn(_worker, args=(str(tmp),), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("the two ranks did not finish in 120 s")
    return tmp


def test_each_rank_writes_its_own_meta_parts_and_rows(runs):
    run = runs / "syncFalse"
    assert json.loads((run / "meta.json").read_text())["rank"] == 0
    meta1 = json.loads((run / schema.meta_name(1)).read_text())
    assert (meta1["rank"], meta1["world_size"]) == (1, 2)
    assert sorted(p.name for p in (run / "trace").glob(schema.STEPS_GLOB)) == [
        schema.part_name("steps", 0, 0), schema.part_name("steps", 1, 0), schema.part_name("steps", 1, 1)]
    steps = pl.read_parquet(run / "trace" / schema.STEPS_GLOB)
    assert steps.group_by("rank").len().sort("rank").rows() == [(0, 4), (1, 4)]
    layers = pl.read_parquet(run / "trace" / schema.LAYERS_GLOB)
    assert sorted(layers["rank"].unique().to_list()) == [0, 1]


def test_without_sync_failures_only_the_failing_rank_snapshots(runs):
    names = sorted(p.name for p in (runs / "syncFalse" / "snapshots").glob(schema.SNAPSHOT_GLOB))
    assert names == [schema.snapshot_name(2, 1, "nonfinite_loss")]


def test_with_sync_failures_every_rank_snapshots_the_failing_step(runs):
    names = sorted(p.name for p in (runs / "syncTrue" / "snapshots").glob(schema.SNAPSHOT_GLOB))
    # rank 1 stays NaN after step 2 (SGD applied its NaN gradients): one stretch, one snapshot each
    assert names == [schema.snapshot_name(2, 0, "peer_failure"), schema.snapshot_name(2, 1, "nonfinite_loss")]
    snap = load_snapshot(runs / "syncTrue" / "snapshots" / names[0])
    assert (snap["rank"], snap["world_size"], snap["step"]) == (0, 2, 2)

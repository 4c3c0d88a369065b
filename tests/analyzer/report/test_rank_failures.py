"""``repeated_rank_failure``: a rank (or a host's ranks) whose loss goes non-finite at several steps while the
others' never does, named by ``analyzer report`` on a real four-rank run directory.

The ranks are real Recorders, each under torch.distributed's ``fake`` process group (one process plays
rank 0, then 1, 2, 3: no collective runs), so meta.json and the trace parts carry real rank numbers; the
host each rank records is what ``socket.gethostname`` says while its Recorder starts. A NaN in a rank's
batch is the fault: GradScaler skips that step and training goes on.
"""
from __future__ import annotations

import json
import socket

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from torch.testing._internal.distributed.fake_pg import FakeStore

from analyzer.cli import main
from recorders import Recorder
from tests.recorders.models import batches, build_mlp, mse_loss, sgd

REFS = {"factory": "tests.recorders.models:build_mlp", "loss_fn": "tests.recorders.models:mse_loss"}
WORLD = 4


def _four_ranks(run, monkeypatch, bad: dict[int, tuple[int, ...]], hosts=("node-a",) * WORLD, steps: int = 20):
    for rank in range(WORLD):
        dist.init_process_group("fake", rank=rank, world_size=WORLD, store=FakeStore())
        try:
            monkeypatch.setattr(socket, "gethostname", lambda h=hosts[rank]: h)
            torch.manual_seed(0)
            model, scaler = build_mlp(), torch.amp.GradScaler("cpu", init_scale=256.0)
            opt = sgd(model)
            with Recorder(run, model, **REFS, scaler=scaler, amp_dtype=torch.float16, optimizer=opt) as rec:
                for step, batch in enumerate(batches(steps, seed=10 + rank)):
                    if step in bad.get(rank, ()):
                        batch["x"][0, 0] = float("nan")  # this rank's sample is corrupt at this step
                    rec.begin_step(step, batch)
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = mse_loss(model, batch)
                    scaler.scale(loss).backward()
                    rec.end_step(loss)
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad()
        finally:
            dist.destroy_process_group()
    return run


def _findings(run, check="repeated_rank_failure"):
    res = CliRunner().invoke(main, ["report", str(run), "--json"])
    assert res.exit_code == 0, res.output
    return [f for f in json.loads(res.output)["findings"] if f["check"] == check]


def test_one_rank_failing_at_three_steps_is_named_with_its_steps(tmp_path, monkeypatch):
    run = _four_ranks(tmp_path / "run", monkeypatch, {2: (5, 11, 17)})
    [f] = _findings(run)
    assert (f["severity"], f["step"], f["rank"]) == ("warning", 5, 2)
    assert f["evidence"]["ranks"] == [2] and f["evidence"]["steps"] == [5, 11, 17]
    assert f["evidence"]["nonfinite_steps_per_rank"] == {"0": 0, "1": 0, "2": 3, "3": 0}
    assert f["message"].startswith("rank 2 had a non-finite loss at 3 steps (5, 11, 17) while the other 3 ranks had "
                                   "none: the fault follows that rank (its GPU or memory, or its data shard)")
    assert f["evidence"]["host"] is None  # one host for every rank: no host to blame
    text = CliRunner().invoke(main, ["report", str(run)]).output
    assert "repeated_rank_failure @ step 5 (rank 2): rank 2 had a non-finite loss at 3 steps" in text


def test_the_ranks_of_one_host_failing_repeatedly_name_the_host(tmp_path, monkeypatch):
    hosts = ("node-a", "node-a", "node-b", "node-b")
    run = _four_ranks(tmp_path / "run", monkeypatch, {2: (4, 9), 3: (6, 13)}, hosts=hosts)
    [f] = _findings(run)
    assert f["evidence"]["ranks"] == [2, 3] and f["evidence"]["host"] == "node-b" and f["rank"] is None
    assert f["step"] == 4 and f["evidence"]["steps"] == [4, 6, 9, 13]
    assert "ranks 2, 3 had non-finite losses at 2, 2 steps (4, 6, 9, 13) while the other 2 ranks had none: the " \
           "fault follows host node-b, where they run" in f["message"]


def test_a_rank_that_failed_once_is_not_a_repeated_failure(tmp_path, monkeypatch):
    run = _four_ranks(tmp_path / "run", monkeypatch, {1: (7,)})
    assert _findings(run) == []
    # the first-failure check still names it (the independent scalers also diverge: another rank_divergence)
    [div] = [f for f in _findings(run, "rank_divergence") if "had the first non-finite loss" in f["message"]]
    assert div["rank"] == 1 and div["step"] == 7


def test_failures_spread_over_most_ranks_are_not_blamed_on_one(tmp_path, monkeypatch):
    run = _four_ranks(tmp_path / "run", monkeypatch, {0: (3, 8), 1: (5, 12), 2: (6, 14)})
    assert _findings(run) == []

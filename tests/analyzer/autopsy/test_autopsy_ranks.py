"""``analyzer autopsy`` on a real two-rank run: one snapshot replayed per failing rank.

Two processes over gloo (``tests/dist_worker.py``'s unwrapped FP32 MLP, ``sync_failures=True``):
rank 1's target holds an inf at step 2, so rank 1 snapshots ``nonfinite_loss`` and rank 0, whose
own step is fine, snapshots ``peer_failure`` at the same step.
"""
from __future__ import annotations

import json
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from click.testing import CliRunner

from analyzer.autopsy import run_autopsy
from analyzer.cli import main
from recorders import schema
from tests import dist_worker

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="torch.distributed with gloo is not available")]

NAN_STEP = 2  # train_unwrapped: the inf in rank 1's target


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("ranks") / "unwrapped_synced"
    # NB: spawn, not fork (tests/test_distributed.py: forked children hung in gloo).
    mp.spawn(dist_worker.train_rank, args=(2, _free_port(), {}, 4, 1, NAN_STEP, {str(run): True}),
             nprocs=2, join=True)
    return run


def test_two_failing_ranks_get_one_replay_each_and_the_faulty_rank_is_the_answer(run_dir):
    a = run_autopsy(run_dir, device="cpu")
    assert [(p["rank"], p["step"], p["reason"]) for p in a.picked] == [(0, NAN_STEP, "peer_failure"),
                                                                      (1, NAN_STEP, "nonfinite_loss")]
    by_rank = {schema.SNAPSHOT_RE.match(r.snapshot.rsplit("/", 1)[-1])[2]: r.verdict for r in a.replays}
    assert by_rank == {"00000": "healthy", "00001": "nonfinite_input"}
    # rank 0 only stopped because its peer failed: the answer is rank 1's inf in the batch
    assert a.verdict == "nonfinite_input" and a.primary.snapshot.endswith(
        schema.snapshot_name(NAN_STEP, 1, "nonfinite_loss"))
    answer = a.answer()
    assert f", step {NAN_STEP}, rank 1 (" in answer[1]
    assert any(line.startswith(f"also step {NAN_STEP}, rank 0 (peer_failure): healthy") for line in answer)


def test_rank_restricts_the_autopsy_to_that_ranks_snapshot(run_dir):
    res = CliRunner().invoke(main, ["autopsy", str(run_dir), "--rank", "1", "--json", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [p["rank"] for p in out["picked"]] == [1] and out["verdict"] == "nonfinite_input"
    assert out["report"]["rank"] == 1

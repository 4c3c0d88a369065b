"""The distributed replay of DDP snapshots: ``torchrun --nproc-per-node 2 -m analyzer replay SNAPSHOT``.

The runs are ``tests/ddp_runs.py`` (2 ranks, gloo, CPU, one spawn): ``compress`` trains in FP32 under
``fp16_compress_hook``, and rank 1's gradient of ``2.weight`` (8.1e4) is beyond FP16's 65504 while rank 0's
(4.5e3) is not: the hook's cast makes it inf and every rank's reduced gradient is inf. Every torchrun is a
subprocess with a wall-clock timeout, every collective of the replay has one (``AMP_AUTOPSY_DIST_TIMEOUT``).
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from analyzer.cli import main
from recorders import schema
from tests.test_distributed_replay import errors, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                                   reason="torch.distributed with gloo is not available")]

SNAP = "step00000000-r00000-nonfinite_grads.pt"


@pytest.fixture(scope="module")
def compress_json(ddp_runs) -> dict:
    proc = torchrun(2, "replay", str(ddp_runs["compress"] / schema.SNAPSHOT_DIR / SNAP), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_the_fp16_compress_all_reduce_is_the_overflow_with_each_ranks_finite_gradient_and_the_inf_sum(compress_json):
    d = compress_json
    c = d["culprit"]
    assert d["verdict"] == "overflow" and c["op"] == "c10d.allreduce_" and c["module"] == "2.weight"
    assert c["phase"] == "backward" and c["input_dtypes"] == ["float32"]  # the gradient as the hook got it
    ranks = c["collective"]["ranks"]
    # each rank's gradient of 2.weight is about 4.5 * its batch value (1000 on rank 0, 18000 on rank 1)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert 3e3 < ranks[0]["input_absmax"] < 65504 < ranks[1]["input_absmax"] < 1e5
    assert all(r["output_absmax"] == "inf" for r in ranks)  # --json writes non-finite floats as strings
    assert c["collective"]["reduce_dtype"] == "float16"
    # the FP32 run's mean of the two: finite, below FP16's max
    assert 3e4 < c["collective"]["fp32_output_absmax"] < 65504
    assert "rank(s) [1]'s gradient is beyond float16's max" in d["summary"]
    assert d["distributed"]["ddp"]["comm_hook"] == "fp16_compress_hook" and d["precision_mode"] == "reduce_only"


def test_the_fp32_all_reduce_fix_is_tried_on_every_rank_and_verified_against_the_fp32_run(compress_json):
    fixes = compress_json["fixes"]
    assert [(f["name"], f["status"]) for f in fixes] == [("reduce_fp32", "verified")]
    assert any(a.startswith("[verified] All-reduce the gradients in FP32: register no fp16_compress_hook")
               for a in compress_json["advice"])


def test_the_one_process_replay_says_it_cannot_see_the_all_reduce_and_names_the_torchrun_command(ddp_runs):
    snap = ddp_runs["compress"] / schema.SNAPSHOT_DIR / "step00000000-r00001-nonfinite_grads.pt"
    res = CliRunner().invoke(main, ["replay", str(snap), "--json"])
    d = json.loads(res.stdout)
    assert d["verdict"] != "healthy" and d["not_reproduced"]["collectives_replayed"] is False
    assert d["not_reproduced"]["distributed_replay"] == "torchrun --nproc-per-node 2 -m analyzer replay SNAPSHOT"
    assert "DDP's fp16_compress_hook reduced the gradients in float16" in d["summary"]


def test_a_hook_of_the_users_own_is_one_error_line_naming_the_one_process_replay(ddp_runs):
    proc = torchrun(2, "replay", str(ddp_runs["custom"] / schema.SNAPSHOT_DIR / "step00000000-r00000-manual.pt"))
    lines = errors(proc)
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-2000:]
    assert "halve_then_allreduce" in lines[0] and "not one of torch's built-in hooks" in lines[0]


def test_a_snapshot_of_the_ddp_wrapper_replays_on_two_ranks_and_in_one_process(ddp_runs):
    snap = ddp_runs["wrapper"] / schema.SNAPSHOT_DIR / "step00000000-r00000-manual.pt"
    assert next(iter(torch.load(snap, weights_only=True)["model_state"])).startswith("module.")
    proc = torchrun(2, "replay", str(snap), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(proc.stdout)
    assert d["verdict"] == "healthy" and d["distributed"]["ddp"]["comm_hook"] == "allreduce_hook"
    # each rank reduced its gradients once per parameter (2 Linear layers: 4 parameters)
    assert [r["collectives"].get("c10d.allreduce_") for r in d["runs"]["float32"]] == [4, 4]
    one = json.loads(CliRunner().invoke(main, ["replay", str(snap), "--json"]).stdout)
    assert one["verdict"] == "healthy" and math.isfinite(one["runs"]["float32"]["loss"])


def test_a_ddp_snapshot_without_the_ddp_entry_is_one_error_line(ddp_runs, tmp_path):
    src = ddp_runs["plain"] / schema.SNAPSHOT_DIR
    for p in src.glob(schema.SNAPSHOT_GLOB):
        snap = torch.load(p, weights_only=True)
        snap["ddp"], snap["format_version"] = None, 8
        torch.save(snap, tmp_path / p.name)
    proc = torchrun(2, "replay", str(tmp_path / "step00000000-r00000-manual.pt"))
    lines = errors(proc)
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-2000:]
    assert "neither a sharded (FSDP2) nor a DDP snapshot" in lines[0]


def test_an_ordinary_ops_overflow_under_ddp_gets_the_one_process_replays_classification(ddp_runs, tmp_path):
    # the plain run's step under FP16 autocast with every input 3e4: 2's weight-gradient mm (about 4 * 3.4e4 per
    # element in FP32) is beyond FP16's 65504 on each rank, before any all-reduce
    for p in (ddp_runs["plain"] / schema.SNAPSHOT_DIR).glob(schema.SNAPSHOT_GLOB):
        snap = torch.load(p, weights_only=True)
        snap["amp_dtype"], snap["batch"]["x"] = "float16", torch.full_like(snap["batch"]["x"], 3e4)
        torch.save(snap, tmp_path / p.name)
    path = tmp_path / "step00000000-r00000-manual.pt"
    proc = torchrun(2, "replay", str(path), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    dist_answer = json.loads(proc.stdout)
    one = json.loads(CliRunner().invoke(main, ["replay", str(path), "--json"]).stdout)
    assert dist_answer["verdict"] == one["verdict"] == "overflow"
    for key in ("op", "module", "phase"):
        assert dist_answer["culprit"][key] == one["culprit"][key]
    assert dist_answer["culprit"]["op"] == "aten.mm" and dist_answer["culprit"]["rank"] == 0


def test_a_rank_killed_mid_replay_ends_every_process_with_one_error_line(ddp_runs):
    # rank 1 SIGKILLs itself in the FP32 run's forward; rank 0's next collective is the first all-reduce in backward
    proc = torchrun(2, "replay", str(ddp_runs["compress"] / schema.SNAPSHOT_DIR / SNAP), "--loss-fn",
                    "tests.fsdp_reduce_runs:sum_loss_killing_rank_1", timeout_env="30")
    lines = errors(proc)
    assert proc.returncode != 0 and len(lines) == 1 and "peer rank died" in lines[0], proc.stderr[-2000:]


def test_a_rank_killed_while_rank_0_computes_ends_rank_0_with_one_error_line_when_torchrun_stops_it(ddp_runs):
    # rank 0 sleeps in its forward while rank 1 dies: torchrun SIGTERMs rank 0 before any collective can fail
    proc = torchrun(2, "replay", str(ddp_runs["compress"] / schema.SNAPSHOT_DIR / SNAP), "--loss-fn",
                    "tests.fsdp_reduce_runs:sum_loss_killing_rank_1_while_rank_0_computes", timeout_env="60")
    lines = errors(proc)
    assert proc.returncode != 0 and len(lines) == 1 and "peer rank died" in lines[0], proc.stderr[-2000:]
    assert "SIGTERM" in lines[0]


def test_a_missing_ranks_snapshot_is_one_error_line_on_rank_0(ddp_runs, tmp_path):
    src = ddp_runs["compress"] / schema.SNAPSHOT_DIR / SNAP
    (tmp_path / SNAP).write_bytes(src.read_bytes())  # rank 1's file of the step is not there
    proc = torchrun(2, "replay", str(tmp_path / SNAP))
    lines = errors(proc)
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-2000:]
    assert "r00001" in lines[0] or "rank 1" in lines[0]


def test_torchrun_autopsy_of_the_ddp_run_replays_its_first_failing_snapshot_to_the_all_reduce(ddp_runs):
    proc = torchrun(2, "autopsy", str(ddp_runs["compress"]), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(proc.stdout)
    assert d["autopsy_snapshot"].endswith(SNAP)
    assert d["verdict"] == "overflow" and d["culprit"]["op"] == "c10d.allreduce_"


def test_a_ddp_step_replayed_on_one_of_its_two_ranks_is_the_one_process_replay_naming_the_two_rank_command(ddp_runs):
    proc = torchrun(1, "replay", str(ddp_runs["compress"] / schema.SNAPSHOT_DIR / SNAP), "--json")
    assert proc.returncode == 0 and not errors(proc), proc.stderr[-2000:]
    d = json.loads(proc.stdout)
    assert "distributed" not in d  # WORLD_SIZE 1: no process group, rank 0's snapshot in one process
    assert d["not_reproduced"]["collectives_replayed"] is False
    assert d["not_reproduced"]["distributed_replay"] == "torchrun --nproc-per-node 2 -m analyzer replay SNAPSHOT"


@pytest.fixture(scope="module")
def accum_json(ddp_runs) -> dict:
    snap = ddp_runs["accum"] / schema.SNAPSHOT_DIR / SNAP
    assert len(torch.load(snap, weights_only=True)["batch"]) == 2  # the Recorder kept both micro-batches
    proc = torchrun(2, "replay", str(snap), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_a_ddp_step_accumulated_under_no_sync_overflows_in_its_one_all_reduce_after_the_last_micro_batch(accum_json):
    d = accum_json
    c = d["culprit"]
    assert d["verdict"] == "overflow" and (c["op"], c["module"]) == ("c10d.allreduce_", "2.weight")
    # each micro-batch's gradient on rank 1 is about 4.05e4 (fits FP16); reduced once, the accumulated 8.1e4 does not
    ranks = c["collective"]["ranks"]
    assert 3e3 < ranks[0]["input_absmax"] < 65504 < ranks[1]["input_absmax"] < 1e5
    assert all(r["output_absmax"] == "inf" for r in ranks)


def test_a_ddp_step_accumulated_under_no_sync_reduces_each_parameter_once_and_verifies_the_fp32_all_reduce(
        accum_json):
    # 2 Linear layers, 4 parameters: one all-reduce each per run, not one per micro-batch
    for p, per_rank in accum_json["runs"].items():
        assert [r["collectives"].get("c10d.allreduce_") for r in per_rank] == [4, 4], p
    assert [(f["name"], f["status"]) for f in accum_json["fixes"]] == [("reduce_fp32", "verified")]
    assert accum_json["fixes"][0]["detail"].endswith("(verified on each of the 2 ranks)")  # the ranks agreed

"""HSDP under torchrun: a snapshot sharded on a 2x2 ("replicate", "shard") mesh replayed on that mesh, collectives
included.

The runs (``tests/fsdp_hsdp_runs.py``, 4 ranks, gloo, CPU, recorded once): ``overflow`` (rank 1's first Linear's
FP16 addmm, an ordinary op) and ``reduce`` (each shard group's FP16 reduce-scatter finite, the all-reduce across
the replicas beyond FP16's max). Every torchrun is a subprocess with a timeout, every collective of the replay
has one (``AMP_AUTOPSY_DIST_TIMEOUT``).
"""
from __future__ import annotations

import json

import pytest

from analyzer.load import load_snapshot
from analyzer.load.dcp import dcp_directory, read_dcp_metadata
from analyzer.replay import Replay, replay_snapshot
from tests import fsdp_hsdp_runs as hr
from tests import fsdp_runs as fr
from tests.test_distributed_replay import errors, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not fr.fsdp_available(), reason="needs FSDP2, DCP and gloo")]

SNAP0 = "step00000000-r00000-nonfinite_grads.pt"
SNAP1 = "step00000000-r00001-nonfinite_loss.pt"  # the overflow run's rank 1: the rank whose addmm overflowed
MESH = {"device_type": "cpu", "shape": [2, 2], "dim_names": ["replicate", "shard"],
        "placements": ["replicate", "shard(0)"]}


@pytest.fixture(scope="session")
def hsdp_runs(tmp_path_factory):
    return hr.record_hsdp_runs(tmp_path_factory.mktemp("hsdp"))


@pytest.fixture(scope="session")
def overflow_answers(hsdp_runs):
    """The torchrun replay's --json (named by rank 0's snapshot), the one-process replay of rank 1 and its fixes."""
    snaps = hsdp_runs["overflow"] / "snapshots"
    proc = torchrun(hr.WORLD, "replay", str(snaps / SNAP0), "--json")
    assert proc.returncode == 0 and not errors(proc), proc.stderr[-3000:]
    one = Replay(snaps / SNAP1)
    result = one.run()
    return json.loads(proc.stdout), result, one.try_fixes(result)


@pytest.fixture(scope="session")
def reduce_json(hsdp_runs):
    proc = torchrun(hr.WORLD, "replay", str(hsdp_runs["reduce"] / "snapshots" / SNAP0), "--json")
    assert proc.returncode == 0 and not errors(proc), proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_recorder_writes_the_2d_mesh_its_names_and_hsdp_placements_and_one_dcp_directory(hsdp_runs):
    run = hsdp_runs["overflow"]
    assert json.loads((run / "meta.json").read_text())["fsdp"]["mesh"] == MESH
    snaps = sorted((run / "snapshots").glob("*.pt"))
    assert len(snaps) == hr.WORLD
    for path in snaps:
        snap = load_snapshot(path)
        assert snap.fsdp["mesh"] == MESH and snap.fsdp["world_size"] == hr.WORLD
    # the four ranks saved into one DCP directory; each replica group holds every shard, DCP keeps one copy
    md = read_dcp_metadata(dcp_directory(str(snaps[0]), load_snapshot(snaps[0])))
    assert list(md.state_dict_metadata["model.0.weight"].size) == [8, 8]
    assert sorted({tuple(c.offsets) for c in md.state_dict_metadata["model.0.weight"].chunks}) == [(0, 0), (4, 0)]


def test_torchrun_of_an_hsdp_snapshot_gives_the_one_process_verdict_op_module_and_fixes_of_the_culprit_rank(
        overflow_answers):
    dist, one, fixes = overflow_answers
    assert dist["verdict"] == one.verdict == "overflow"
    c = dist["culprit"]
    want = ("aten.addmm", "0", "forward", 1)  # rank 1's 6e4-valued batch: the first Linear's FP16 sum reaches ~7e4
    assert (c["op"], c["module"], c["phase"], c["rank"]) == (one.culprit["op"], one.culprit["module"],
                                                             one.culprit["phase"], 1) == want
    assert dist["summary"].startswith(one.summary)
    assert [(f["name"], f["status"]) for f in dist["fixes"]] == [(f.name, f.status) for f in fixes]
    assert all(f"on each of the {hr.WORLD} ranks" in f["detail"] for f in dist["fixes"])


def test_the_hsdp_replay_reduce_scatters_in_each_shard_group_and_all_reduces_across_replicas(overflow_answers):
    dist, _, _ = overflow_answers
    assert (dist["distributed"]["world_size"], dist["distributed"]["recorded_world_size"]) == (4, 4)
    # two sharded modules hold parameters (0 and 2): per rank and run, one all-gather each in the forward and
    # the backward, one reduce-scatter each in its shard group, then one all-reduce each across the replicas
    for p in ("float32", "float16"):
        for rank in range(hr.WORLD):
            assert dist["runs"][p][rank]["collectives"] == {"c10d._allgather_base_": 4,
                                                            "c10d._reduce_scatter_base_": 2, "c10d.allreduce_": 2}


def test_torchrun_names_the_fp16_all_reduce_across_replicas_its_ranks_inputs_and_verifies_reduce_fp32(reduce_json):
    r = reduce_json
    assert r["verdict"] == "overflow"
    c = r["culprit"]
    assert (c["op"], c["phase"], c["module"], c["rank"]) == ("c10d.allreduce_", "backward", "2", 0)
    coll = c["collective"]
    assert coll["reduce_dtype"] == "float16"
    # rank 0's replica group: itself and rank 2, the first rank of the other shard group
    assert coll["group"] == [0, 2]
    assert "summed the values of ranks 0, 2 (its process group) in float16" in r["summary"]
    ranks = {x["rank"]: x for x in coll["ranks"]}
    # ranks 0 and 2 hold 2.weight's one row: each shard group summed two ranks' ~2.7e4 into ~5.4e4 < 65504 ...
    assert all(40000 < float(ranks[k]["input_absmax"]) < 65504 for k in (0, 2))
    # ... and the two replicas' sum is inf in FP16 (1.07e5 in FP32); ranks 1 and 3 hold its padding only
    assert ranks[0]["output_absmax"] == ranks[2]["output_absmax"] == "inf"
    assert float(ranks[1]["output_absmax"]) == float(ranks[3]["output_absmax"]) == 0.0
    assert 65504 < float(coll["fp32_output_absmax"]) < 1.2e5
    fixes = {f["name"]: f["status"] for f in r["fixes"]}
    assert fixes == {"reduce_fp32": "verified"}
    assert [x["grads_finite"] for x in r["runs"]["float16"]] == [False, True, False, True]


def test_the_one_process_replay_of_the_hsdp_reduce_overflow_says_it_cannot_see_collectives(hsdp_runs):
    r = replay_snapshot(hsdp_runs["reduce"] / "snapshots" / SNAP0)
    assert r.verdict != "healthy"
    assert "cannot see the collectives" in r.summary and "torchrun --nproc-per-node 4" in r.summary


def test_an_hsdp_snapshot_on_fewer_ranks_than_its_mesh_is_one_error_line_naming_the_count(hsdp_runs):
    proc = torchrun(2, "replay", str(hsdp_runs["reduce"] / "snapshots" / SNAP0))
    lines = errors(proc)
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-2000:]
    assert "HSDP on a 2x2 device mesh (replicate, shard)" in lines[0] and "--nproc-per-node 4" in lines[0]


def test_torchrun_autopsy_of_the_hsdp_run_replays_its_first_failing_snapshot_on_the_mesh(hsdp_runs):
    proc = torchrun(hr.WORLD, "autopsy", str(hsdp_runs["reduce"]), "--json")
    assert proc.returncode == 0 and not errors(proc), proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["autopsy_snapshot"].endswith(SNAP0)
    assert (r["verdict"], r["culprit"]["op"], r["culprit"]["collective"]["group"]) == ("overflow", "c10d.allreduce_",
                                                                                       [0, 2])

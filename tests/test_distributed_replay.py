"""The distributed replay: ``torchrun --nproc-per-node N -m analyzer replay SNAPSHOT`` on real 2-rank FSDP2 runs.

Two recorded runs (gloo, CPU): ``tests/fsdp_reduce_runs.py``, whose FP16 reduce-scatter overflows while
each rank's gradient is finite (``reduce_dtype=torch.float16``, ``set_gradient_divide_factor(1.0)``), and
the ``synced`` run of ``tests/fsdp_runs.py`` (inf in rank 1's shard of ``0.weight``). Every torchrun is a
subprocess with a wall-clock timeout, and every collective of the replay has one
(``AMP_AUTOPSY_DIST_TIMEOUT``): nothing here can hang.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.errors import BadInputError
from analyzer.load import load_snapshot
from analyzer.replay import Replay, replay_snapshot
from tests import fsdp_reduce_runs as rr
from tests import fsdp_runs as fr

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not fr.fsdp_available(), reason="needs FSDP2, DCP and gloo")]

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 180
SNAP = "step00000000-r00000-nonfinite_grads.pt"


def torchrun(nproc: int, *args: str, timeout_env: str = "60") -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m analyzer ARGS``, bounded."""
    env = dict(os.environ, AMP_AUTOPSY_DIST_TIMEOUT=timeout_env, OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "analyzer", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [x for x in (proc.stdout + proc.stderr).splitlines() if x.startswith("Error:")]


@pytest.fixture(scope="module")
def reduce_run(tmp_path_factory) -> Path:
    return rr.record_reduce_overflow(tmp_path_factory.mktemp("reduce"))


@pytest.fixture(scope="module")
def reduce_json(reduce_run) -> dict:
    proc = torchrun(2, "replay", str(reduce_run / "snapshots" / SNAP), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_the_recorder_writes_each_sharded_modules_reduce_dtype_and_divide_factor_into_meta_and_snapshots(reduce_run):
    policy = {"param_dtype": "float16", "reduce_dtype": "float16", "output_dtype": None}
    # the loop set the factor on 0 and 2 and on the root (which holds no parameter: FSDP keeps none for it)
    want = [{"path": "", "mp_policy": policy, "gradient_divide_factor": None},
            {"path": "0", "mp_policy": policy, "gradient_divide_factor": 1.0},
            {"path": "2", "mp_policy": policy, "gradient_divide_factor": 1.0}]
    meta = json.loads((reduce_run / "meta.json").read_text())
    assert meta["format_version"] >= 8 and meta["fsdp"]["modules"] == want
    for name in sorted(p.name for p in (reduce_run / "snapshots").glob("*.pt")):
        snap = load_snapshot(reduce_run / "snapshots" / name)
        assert snap.fsdp["modules"] == want and snap.fsdp["dcp_dir"] == "step00000000-nonfinite_grads.dcp"


def test_torchrun_replay_names_the_fp16_reduce_scatter_with_both_ranks_inputs_and_the_reduced_value(reduce_json):
    r = reduce_json
    assert r["verdict"] == "overflow" and r["distributed"]["world_size"] == 2
    c = r["culprit"]
    assert (c["op"], c["phase"], c["module"], c["rank"]) == ("c10d._reduce_scatter_base_", "backward", "2", 0)
    coll = c["collective"]
    assert coll["reduce_dtype"] == "float16"
    ranks = {x["rank"]: x for x in coll["ranks"]}
    # each rank's flat gradient buffer: 2.weight's gradient ~4.5 * X_VALUE = 4.03e4 < 65504 on both ranks ...
    assert all(30000 < float(ranks[k]["input_absmax"]) < 65504 for k in (0, 1))
    # ... and their sum, which rank 0 receives (it holds 2.weight's one row), is inf in FP16, 8.06e4 in FP32
    assert ranks[0]["output_absmax"] == "inf"
    assert 65504 < float(coll["fp32_output_absmax"]) < 1e5
    assert "every rank's input was finite" in r["summary"]


def test_torchrun_replay_verifies_reduce_dtype_float32_on_every_rank(reduce_json):
    # the registry's fixes for a collective's culprit: reduce_fp32 alone (no op_fp32, module_fp32, bf16...), each
    # rank's run judged against its own FP32 run and the status the ranks agreed on
    assert [(f["name"], f["status"]) for f in reduce_json["fixes"]] == [("reduce_fp32", "verified")]
    assert reduce_json["fixes"][0]["detail"].endswith("(verified on each of the 2 ranks)")
    assert any("reduce_dtype=torch.float32" in a for a in reduce_json["advice"])
    # the FP16 run fails on rank 0 only (the rank the sum reached), its FP32 run on none
    runs = reduce_json["runs"]
    assert [x["grads_finite"] for x in runs["float16"]] == [False, True]
    assert all(x["grads_finite"] for x in runs["float32"])


def test_the_one_process_replay_of_the_reduce_overflow_says_it_cannot_see_collectives(reduce_run):
    r = replay_snapshot(reduce_run / "snapshots" / SNAP)
    assert r.verdict != "healthy"
    assert "cannot see the collectives" in r.summary and "torchrun --nproc-per-node 2" in r.summary
    assert r.to_dict()["not_reproduced"]["distributed_replay"].startswith("torchrun --nproc-per-node 2")


def test_more_ranks_than_recorded_is_one_error_line_and_every_process_exits(reduce_run):
    proc = torchrun(3, "replay", str(reduce_run / "snapshots" / SNAP))
    assert proc.returncode != 0
    lines = errors(proc)
    assert len(lines) == 1 and "recorded on 2 ranks and this replay has 3" in lines[0], proc.stderr[-2000:]


def test_a_rank_killed_mid_replay_ends_every_process_with_one_error_line(reduce_run):
    # rank 1's loss function SIGKILLs its process in the FP32 run's forward, after the first all-gather
    proc = torchrun(2, "replay", str(reduce_run / "snapshots" / SNAP), "--loss-fn",
                    "tests.fsdp_reduce_runs:sum_loss_killing_rank_1", timeout_env="30")
    assert proc.returncode != 0
    lines = errors(proc)
    assert len(lines) == 1 and "peer rank died" in lines[0], proc.stderr[-2000:]


def test_torchrun_autopsy_replays_the_runs_first_failing_snapshot_on_every_rank(reduce_run):
    proc = torchrun(2, "autopsy", str(reduce_run), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["autopsy_snapshot"].endswith(SNAP)
    assert r["verdict"] == "overflow" and r["culprit"]["op"] == "c10d._reduce_scatter_base_"


def test_a_4_rank_snapshot_replays_on_2_ranks_through_dcp_resharding_and_says_what_it_left_out(tmp_path):
    run = rr.record_reduce_overflow(tmp_path, world=4, timeout_s=180.0)
    proc = torchrun(2, "replay", str(run / "snapshots" / SNAP), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert (r["distributed"]["world_size"], r["distributed"]["recorded_world_size"]) == (2, 4)
    assert any("DCP resharded the weights" in n and "ranks 2..3's batches are left out" in n
               for n in r["distributed"]["notes"])
    # two ranks' gradients of ~4.03e4 still sum beyond FP16's max: the same culprit as on 4 ranks
    assert r["verdict"] == "overflow" and r["culprit"]["op"] == "c10d._reduce_scatter_base_"
    assert [x["rank"] for x in r["culprit"]["collective"]["ranks"]] == [0, 1]


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return fr.shared_fsdp_runs(tmp_path_factory)


@pytest.mark.parametrize("kind", ["synced", "batch_nan"])
def test_the_fsdp_test_snapshots_replay_under_torchrun_to_the_one_process_verdict_op_and_module(fsdp, kind):
    snap = fsdp.dirs[kind] / "snapshots" / f"step{fr.FAULT_STEP:08d}-r{fr.FAULT_RANK:05d}-nonfinite_loss.pt"
    replay = Replay(snap)
    one = replay.run()
    proc = torchrun(2, "replay", str(snap), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    dist = json.loads(proc.stdout)
    assert dist["verdict"] == one.verdict == "nonfinite_input"
    assert (dist["culprit"]["op"], dist["culprit"]["module"]) == (one.culprit["op"], one.culprit["module"])
    assert dist["culprit"]["input"] == one.culprit["input"]
    # the fix the registry has for it: nothing to run, the input to look at (check_input, not_tried)
    assert [(f["name"], f["status"], f["title"]) for f in dist["fixes"]] == [
        (f.name, f.status, f.title) for f in replay.try_fixes(one)] == [
        ("check_input", "not_tried", dist["fixes"][0]["title"])]


_VALUE = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=8))
_ENTRY = st.one_of(_VALUE, st.dictionaries(st.sampled_from(["path", "mp_policy", "gradient_divide_factor", "x"]),
                                           st.one_of(_VALUE, st.dictionaries(st.text(max_size=12), _VALUE,
                                                                             max_size=3)), max_size=4))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(modules=st.one_of(_VALUE, st.lists(_ENTRY, max_size=4)))
def test_a_hostile_fsdp_modules_entry_is_one_error_or_a_validated_layout(reduce_run, tmp_path_factory, modules):
    raw = torch.load(reduce_run / "snapshots" / SNAP, weights_only=True)
    raw["fsdp"]["modules"] = modules
    path = tmp_path_factory.mktemp("modules") / SNAP
    torch.save(raw, path)
    try:
        snap = load_snapshot(path)
    except BadInputError as e:
        assert "\n" not in str(e) and "fsdp" in str(e)
        return
    got = snap.fsdp["modules"]
    assert got is None or all(isinstance(m["path"], str) and (m.get("gradient_divide_factor") is None or
                                                              m["gradient_divide_factor"] > 0) for m in got)


def test_a_snapshot_of_local_shards_under_torchrun_is_one_error_line_naming_the_one_process_replay(fsdp):
    snap = fsdp.dirs["local"] / "snapshots" / f"step{fr.FAULT_STEP:08d}-r{fr.FAULT_RANK:05d}-nonfinite_loss.pt"
    proc = torchrun(2, "replay", str(snap))
    lines = errors(proc)
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-2000:]
    assert "not a DCP directory" in lines[0] and "without torchrun" in lines[0]


def test_a_truncated_dcp_data_file_under_torchrun_is_one_error_line_and_the_input_is_left_as_it_was(reduce_run,
                                                                                                      tmp_path):
    import shutil

    dest = tmp_path / "snapshots"
    shutil.copytree(reduce_run / "snapshots", dest)
    data = dest / "step00000000-nonfinite_grads.dcp" / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    before = {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    proc = torchrun(2, "replay", str(dest / SNAP))
    lines = errors(proc)
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-2000:]
    assert "DCP" in lines[0] and "truncated" in lines[0]
    assert {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()} == before


def test_a_model_with_a_non_persistent_buffer_is_built_for_real_and_replays_as_in_one_process(tmp_path):
    # no checkpoint holds the buffer `gain` (0.5): a model built on the meta device would replay with
    # uninitialised memory there, so the replay builds it from the factory before sharding it
    run = rr.record_reduce_overflow(tmp_path, halved=True)
    proc = torchrun(2, "replay", str(run / "snapshots" / SNAP), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    dist = json.loads(proc.stdout)
    one = replay_snapshot(run / "snapshots" / SNAP)
    # rank 0's FP32 forward is the one-process replay's FP32 forward: same weights, same batch, same gain
    assert math.isclose(dist["runs"]["float32"][0]["loss"], one.runs["float32"].loss, rel_tol=1e-5)
    assert dist["verdict"] == "overflow" and dist["culprit"]["op"] == "c10d._reduce_scatter_base_"


def test_a_snapshot_sharded_on_a_2d_mesh_other_than_hsdp_under_torchrun_is_one_error_line(reduce_run, tmp_path):
    import shutil

    dest = tmp_path / "snapshots"
    shutil.copytree(reduce_run / "snapshots", dest)
    for path in sorted(dest.glob("*.pt")):  # every rank's snapshot of the step
        raw = torch.load(path, weights_only=True)
        # FSDP2 with tensor parallelism: parameters sharded on both dimensions, which HSDP never does
        raw["fsdp"]["mesh"] = {"device_type": "cpu", "shape": [1, 2], "dim_names": ["dp", "tp"],
                               "placements": ["shard(0)", "shard(1)"]}
        torch.save(raw, path)
    proc = torchrun(2, "replay", str(dest / SNAP))
    lines = errors(proc)
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-2000:]
    assert "2-D device mesh of 1x2 (dp, tp) placed ['shard(0)', 'shard(1)']" in lines[0]
    assert "HSDP's 2-D mesh" in lines[0] and "without torchrun" in lines[0]

"""Replay of FSDP2 snapshots in one process: the DCP directory consolidated (or every rank's shards
joined), the model rebuilt unsharded, one rank's batch replayed with FSDP's param_dtype emulated.

The snapshots come from real 2-rank gloo FSDP2 runs (``tests/fsdp_runs.py``: BF16 ``param_dtype``,
inf written into rank 1's shard of ``0.weight`` before step 2). Hostile and damaged DCP directories
are copies of the real one, changed; the inputs are never modified.
"""
from __future__ import annotations

import json
import math
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.cli import main
from analyzer.errors import BadInputError
from analyzer.load import load_snapshot
from analyzer.load.dcp import load_sharded_state, sibling_snapshot
from analyzer.render import render_replay_text
from analyzer.replay import replay_snapshot
from tests import fsdp_runs as fr

pytestmark = pytest.mark.skipif(not fr.fsdp_available(), reason="needs FSDP2, DCP and gloo")

NAME = f"step{fr.FAULT_STEP:08d}-r{{rank:05d}}-nonfinite_loss.pt"
DCP = f"step{fr.FAULT_STEP:08d}-nonfinite_loss.dcp"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return fr.shared_fsdp_runs(tmp_path_factory)


def _snap(runs, kind: str, rank: int = fr.FAULT_RANK) -> Path:
    return runs.dirs[kind] / "snapshots" / NAME.format(rank=rank)


@pytest.fixture(scope="module")
def synced(runs):
    return replay_snapshot(_snap(runs, "synced"))


def test_the_dcp_snapshot_replays_to_the_first_op_of_module_0_reading_the_broken_weight(synced):
    r = synced
    assert r.verdict == "nonfinite_input"
    c = r.culprit
    assert c["input"] == f"param:{fr.FAULT_PARAM}" and c["module"] == "0" and c["phase"] == "forward"
    # the first op of Linear 0 that reads its weight: the transpose feeding addmm
    assert c["op"] in ("aten.t", "aten.addmm")
    assert r.nonfinite_inputs == [f"param:{fr.FAULT_PARAM}"]


def test_the_dcp_snapshot_replays_with_fsdps_param_dtype_emulated(synced):
    r = synced
    assert (r.precision_mode, r.precision_dtype) == ("fsdp_param_dtype", "bfloat16")
    # the weight was cast to param_dtype for compute (the stored FP32 shard was not used as is)
    assert r.culprit["precision"] == "bfloat16" and r.culprit["input_dtypes"] == ["bfloat16"]
    assert set(r.runs) == {"float32", "bfloat16"}
    assert "precision mode: fsdp_param_dtype" in render_replay_text(r)


def test_broken_weights_in_an_fsdp_snapshot_get_no_advice_to_change_the_param_dtype(synced):
    assert not any("param_dtype" in a for a in synced.advice)
    assert any("earlier step broke them" in a for a in synced.advice)


def test_the_consolidated_state_is_the_whole_model_with_the_inf_where_rank_1_wrote_it(runs):
    path = _snap(runs, "synced")
    state = load_sharded_state(path, load_snapshot(path))
    assert state["0.weight"].shape == (8, 8) and state["2.weight"].shape == (1, 8)
    bad = (~torch.isfinite(state["0.weight"])).nonzero().tolist()
    assert bad == [list(fr.FAULT_GLOBAL_INDEX)]
    assert all(bool(torch.isfinite(t).all()) for n, t in state.items() if n != fr.FAULT_PARAM)


def test_local_shards_of_every_rank_join_into_the_same_state_as_the_dcp_directory(runs):
    dcp_path, local_path = _snap(runs, "synced"), _snap(runs, "local")
    assert load_snapshot(local_path)["fsdp"]["dcp_dir"] is None
    a = load_sharded_state(dcp_path, load_snapshot(dcp_path))
    b = load_sharded_state(local_path, load_snapshot(local_path))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_replay_with_rank_0_picks_rank_0s_file_and_reads_the_same_weights(runs, synced):
    r0 = replay_snapshot(_snap(runs, "synced"), rank=0)
    assert Path(r0.snapshot).name == NAME.format(rank=0)
    assert r0.verdict == "nonfinite_input" and r0.culprit["module"] == "0"
    assert r0.nonfinite_inputs == synced.nonfinite_inputs


def test_cli_replay_rank_option_json_names_the_sibling_snapshot(runs):
    res = CliRunner().invoke(main, ["replay", str(_snap(runs, "synced")), "--rank", "0", "--json"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.output)
    assert obj["snapshot"].endswith(NAME.format(rank=0)) and obj["precision_mode"] == "fsdp_param_dtype"
    assert obj["runs"]["bfloat16"]["loss"] == "inf" or not math.isfinite(float(obj["runs"]["bfloat16"]["loss"]))


def test_cli_replay_rank_without_a_file_for_that_rank_is_one_error_line(runs):
    res = CliRunner().invoke(main, ["replay", str(_snap(runs, "synced")), "--rank", "7"])
    assert res.exit_code == 1
    assert res.output.startswith("Error:") and len(res.output.strip().splitlines()) == 1
    assert "rank 7" in res.output and "[0, 1]" in res.output


# -- without sync_failures: each rank's snapshot of the step under its own reason ------------------
def test_a_nan_batch_without_sync_failures_replays_in_one_process_to_nonfinite_input_naming_the_batch(runs):
    # rank 1's NaN batch fails its loss (nonfinite_loss); rank 0 only received NaN gradients through
    # the reduce-scatter (nonfinite_grads): the two local-shard snapshots join whatever their reasons
    sdir = runs.dirs["batch_nan_local"] / "snapshots"
    names = sorted(p.name for p in sdir.glob(f"step{fr.FAULT_STEP:08d}-*.pt"))
    assert names == [f"step{fr.FAULT_STEP:08d}-r00000-nonfinite_grads.pt", NAME.format(rank=fr.FAULT_RANK)]
    r = replay_snapshot(sdir / NAME.format(rank=fr.FAULT_RANK))
    assert r.verdict == "nonfinite_input"
    assert r.culprit["input"] == "batch:x" and r.nonfinite_inputs == ["batch:x"]
    assert r.culprit["phase"] == "forward"
    # --rank 0 finds rank 0's file of the step under its other reason
    r0 = replay_snapshot(sdir / NAME.format(rank=fr.FAULT_RANK), rank=0)
    assert r0.snapshot.endswith(f"step{fr.FAULT_STEP:08d}-r00000-nonfinite_grads.pt")


def test_a_rank_that_wrote_no_snapshot_of_the_step_is_named_with_sync_failures_as_the_fix(runs):
    # the uneven run: rank 0 took no snapshot (max_snapshots=0), so rank 1's shards are all there is
    out = _cli_error(runs.dirs["uneven"] / "snapshots" / NAME.format(rank=fr.FAULT_RANK))
    assert f"rank 0 wrote no snapshot of step {fr.FAULT_STEP}" in out
    assert "sync_failures=True" in out


# -- damaged, missing and hostile inputs ---------------------------------------------------------
def _copy(runs, dest: Path, kind: str = "synced", with_dcp: bool = True) -> Path:
    src = runs.dirs[kind] / "snapshots"
    dest.mkdir(parents=True, exist_ok=True)
    for rank in range(fr.WORLD):
        shutil.copy(src / NAME.format(rank=rank), dest)
    if with_dcp and (src / DCP).is_dir():
        shutil.copytree(src / DCP, dest / DCP)
    return dest / NAME.format(rank=fr.FAULT_RANK)


def _cli_error(path: Path) -> str:
    res = CliRunner().invoke(main, ["replay", str(path)])
    assert res.exit_code == 1, res.output
    assert res.output.startswith("Error:") and len(res.output.strip().splitlines()) == 1, res.output
    return res.output


def test_a_missing_dcp_directory_is_one_error_line_naming_it_and_the_fix(runs, tmp_path):
    out = _cli_error(_copy(runs, tmp_path, with_dcp=False))
    assert DCP in out and "missing" in out and "snapshots/ folder" in out


def test_a_missing_rank_of_a_local_shard_snapshot_is_one_error_line_naming_sync_failures(runs, tmp_path):
    path = _copy(runs, tmp_path, kind="local")
    (tmp_path / NAME.format(rank=0)).unlink()
    out = _cli_error(path)
    assert "rank 0" in out and "sync_failures=True" in out


def test_a_pickle_in_the_dcp_metadata_that_would_run_code_is_refused_unrun(runs, tmp_path):
    path = _copy(runs, tmp_path)
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (tmp_path / DCP / ".metadata").write_bytes(pickle.dumps(Evil()))
    out = _cli_error(path)
    assert "refused global" in out and not marker.exists()


def test_the_real_dcp_directory_is_left_unmodified_by_replay(runs, synced):
    d = runs.dirs["synced"] / "snapshots" / DCP
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    replay_snapshot(_snap(runs, "synced"))
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from([".metadata", "__0_0.distcp", "__1_0.distcp"]),
       cut=st.floats(0.0, 0.99), junk=st.binary(max_size=64))
def test_a_truncated_or_overwritten_dcp_file_never_gives_a_traceback(runs, tmp_path_factory, which, cut, junk):
    dest = tmp_path_factory.mktemp("dcp")
    path = _copy(runs, dest)
    f = dest / DCP / which
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * cut)] + junk)
    snap = load_snapshot(path)
    try:
        state = load_sharded_state(path, snap)
    except BadInputError as e:
        assert "\n" not in str(e) and str(dest) in str(e)
    else:  # junk that kept the file readable: whatever loaded is validated, dense tensors by name
        assert all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.one_of(st.sampled_from(["..", ".", "", "/etc", "../synced", "a/b", "x\\y", DCP + "/.."]),
                      st.text(max_size=20), st.integers(), st.none()))
def test_a_hostile_dcp_dir_name_is_refused_without_reading_outside_the_snapshot_folder(runs, tmp_path_factory, name):
    dest = tmp_path_factory.mktemp("name")
    path = _copy(runs, dest, with_dcp=False)
    raw = torch.load(path, weights_only=True)
    raw["fsdp"]["dcp_dir"] = name
    hostile = dest / "hostile" / path.name
    hostile.parent.mkdir()
    torch.save(raw, hostile)
    try:
        snap = load_snapshot(hostile)
        load_sharded_state(hostile, snap)
    except BadInputError as e:
        assert "\n" not in str(e)
    else:
        pytest.fail(f"dcp_dir {name!r} was accepted")


# -- FSDP's float16 param_dtype: an overflow the emulated casts must reproduce ------------------
@pytest.fixture(scope="module")
def fsdp_fp16(tmp_path_factory):
    """One real FSDP2 step on one gloo rank (a spawned process), param_dtype float16, output_dtype float32.

    NB: a spawned process, so that the test process never holds a process group."""
    import torch.multiprocessing as mp

    from . import precision_models as pm

    root = tmp_path_factory.mktemp("fsdp16")
    mp.spawn(pm.train_fsdp_fp16, args=(str(root / "run"), str(root / "rendezvous")), nprocs=1)
    snaps = root / "run" / "snapshots"
    (path,) = [p for p in snaps.iterdir() if p.suffix == ".pt"]
    return path, replay_snapshot(path)


def test_a_one_rank_fsdp_float16_snapshot_holds_its_policy_and_its_shards_not_model_state(fsdp_fp16):
    snap = load_snapshot(fsdp_fp16[0])
    # one rank: no peer to agree with, so the recorder keeps the (whole) local shards in the file
    assert snap.model_state == {} and snap["fsdp"]["dcp_dir"] is None
    assert snap["fsdp"]["local_state"]["0.weight"].shape == (4, 4)
    assert snap["fsdp"]["mp_policy"] == {"param_dtype": "float16", "reduce_dtype": "float32", "output_dtype": "float32"}


def test_fsdp_float16_param_dtype_replays_the_square_overflow_at_module_1_with_fp32_finite(fsdp_fp16):
    r = fsdp_fp16[1]
    assert (r.precision_mode, r.precision_dtype) == ("fsdp_param_dtype", "float16")
    assert r.verdict == "overflow"
    c = r.culprit
    assert (c["op"], c["module"], c["phase"], c["precision"]) == ("aten.mul", "1", "forward", "float16")
    assert c["input_absmax"] == 400.0 and c["shadow"]["float32"] == 160000.0  # x = 2 times the gain 200, squared
    assert r.runs["float32"]["finite"]


def test_fsdp_output_dtype_is_emulated_so_the_loss_reads_only_float32_in_the_float16_run(fsdp_fp16):
    # the model's float16 output is cast to the policy's output_dtype before the loss, as FSDP does:
    # without the cast, mse_loss would read a float16 output beside the float32 targets
    trace = fsdp_fp16[1].traces["float16"]
    mse = next(rec for rec in trace.records if rec.name == "aten.mse_loss")
    assert {str(d) for d in mse.in_dtypes} == {"torch.float32"}
    assert "outputs cast to float32" in fsdp_fp16[1].precision_note


def test_fsdp_float16_advice_keeps_the_module_in_fp32_under_its_own_policy(fsdp_fp16):
    text = " ".join(fsdp_fp16[1].advice)
    assert "MixedPrecisionPolicy(param_dtype=torch.float32" in text and "Keep `1` in FP32: run it under" not in text


def test_a_sibling_of_another_reason_is_found_preferring_the_same_reason_then_the_recorders_order(tmp_path):
    names = ["step00000003-r00001-nonfinite_loss.pt", "step00000003-r00000-overflow_streak.pt",
             "step00000003-r00000-nonfinite_grads.pt", "step00000003-r00000-manual.pt",
             "step00000004-r00002-nonfinite_loss.pt", "step00000003-r00002-manual.pt"]
    for n in names:
        (tmp_path / n).write_bytes(b"")
    assert sibling_snapshot(tmp_path / names[0], 0).name == "step00000003-r00000-nonfinite_grads.pt"
    assert sibling_snapshot(tmp_path / names[3], 0).name == "step00000003-r00000-manual.pt"
    with pytest.raises(BadInputError, match=r"rank 2 wrote no snapshot of step 3.*\[0, 1, 2\].*sync_failures=True"):
        sibling_snapshot(tmp_path / names[0], 2)  # rank 2's manual snapshot stands in for no failure


def test_the_sibling_of_a_second_writers_snapshot_keeps_its_writer_number(tmp_path):
    names = ["step00000002-r00001-w1-nonfinite_loss.pt", "step00000002-r00000-w1-nonfinite_loss.pt",
             "step00000002-r00000-nonfinite_loss.pt"]
    for n in names:
        (tmp_path / n).write_bytes(b"")
    assert sibling_snapshot(tmp_path / names[0], 0).name == names[1]
    with pytest.raises(BadInputError, match=r"rank 2 .*\[0, 1\]"):
        sibling_snapshot(tmp_path / names[0], 2)

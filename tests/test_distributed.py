"""Two real processes over gloo on CPU, a Recorder in each rank: the one distributed test file.

One spawn trains every run in the same process group, to keep the file under ~30 s on a small
machine: DDP with FP16 autocast and a NaN in rank 1's batch, ``plain`` (default) and ``synced``
(``sync_failures=True``); then an unwrapped FP32 MLP per rank with an inf in rank 1's target,
``unwrapped`` and ``unwrapped_synced`` (``dist_worker.train_unwrapped``); then DDP under BF16
autocast with no GradScaler, ``bf16`` (``dist_worker.train_bf16_ddp``), where the averaged NaN
gradient reaches every rank's weights.
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

from analyzer.autopsy import run_autopsy
from analyzer.cli import main
from analyzer.load import load_snapshot
from analyzer.report import build_report
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
                   {str(root / "unwrapped"): False, str(root / "unwrapped_synced"): True}, str(root / "bf16")),
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

    plain, _ = runs
    rep = build_report(str(plain)).to_dict()
    div = [f for f in rep["findings"] if f["check"] == "rank_divergence" and f["severity"] == "error"]
    assert div, f"no rank_divergence error in {[f['check'] for f in rep['findings']]}"
    assert (div[0]["rank"], div[0]["step"]) == (NAN_RANK, NAN_STEP)
    assert f"rank {NAN_RANK}" in div[0]["message"] and f"step {NAN_STEP}" in div[0]["message"]


def test_the_report_cli_merges_both_ranks_and_narrows_to_one_with_rank(runs):
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



def test_autopsy_of_two_failing_ranks_replays_one_snapshot_each_and_answers_with_the_faulty_rank(runs):
    # unwrapped_synced: rank 1's target holds an inf at NAN_STEP, rank 0 snapshots peer_failure
    run_dir = runs[0].parent / "unwrapped_synced"
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


def test_autopsy_rank_restricts_the_autopsy_to_that_ranks_snapshot(runs):
    run_dir = runs[0].parent / "unwrapped_synced"
    res = CliRunner().invoke(main, ["autopsy", str(run_dir), "--rank", "1", "--json", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert [p["rank"] for p in out["picked"]] == [1] and out["verdict"] == "nonfinite_input"
    assert out["report"]["rank"] == 1


# ---------------------------------------------------------------- FSDP2: fully_shard, BF16 params, DCP
# One spawn (tests/fsdp_runs.py, shared with tests/recorders/test_never_crash.py) trains a
# plain, a synced (sync_failures=True), a local (sync_failures=False) and a killed run. Before
# step FAULT_STEP, rank FAULT_RANK writes inf into its shard of FAULT_PARAM.
from tests import fsdp_runs as fr  # noqa: E402


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    if not fr.fsdp_available():
        pytest.skip("needs torch.distributed.fsdp.fully_shard and DCP with gloo")
    return fr.shared_fsdp_runs(tmp_path_factory)


def _fsdp_snapshot(run_dir, rank: int, reason: str = "nonfinite_loss"):
    return load_snapshot(run_dir / schema.SNAPSHOT_DIR / schema.snapshot_name(fr.FAULT_STEP, rank, reason))


def _consolidate(dcp_dir, tmp_path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "full.pt"
    dcp_to_torch_save(str(dcp_dir), str(out))  # one process, no process group
    return torch.load(out, weights_only=True)


def test_fsdp2_meta_records_the_mixed_precision_policy_the_mesh_and_where_each_rank_s_shard_sits(fsdp):
    metas = [json.loads((fsdp.dirs["synced"] / schema.meta_name(r)).read_text()) for r in range(fr.WORLD)]
    policy = {"param_dtype": "bfloat16", "reduce_dtype": "float32", "output_dtype": None}
    for meta in metas:
        # every fully_shard-ed module, outermost first (tests.dist_worker._fsdp_model: 0, 2 and the root),
        # each with FSDP2's default gradient divide factor (None)
        modules = [{"path": p, "mp_policy": policy, "gradient_divide_factor": None} for p in ("", "0", "2")]
        assert meta["fsdp"] == {"mp_policy": policy, "mesh": {"device_type": "cpu", "shape": [2], "dim_names": None,
                                                             "placements": ["shard(0)"]},
                                "world_size": 2, "modules": modules}
    # the [8, 8] weight: rows 0..3 on rank 0, rows 4..7 on rank 1 (FSDP2 chunks dim 0)
    w = [m["params"][0] for m in metas]
    assert [(p["name"], p["shape"], p["sharded"]) for p in w] == [("0.weight", [8, 8], True)] * 2
    assert [(p["local_shape"], p["local_numel"], p["local_offset"]) for p in w] == [
        ([4, 8], 32, [0, 0]), ([4, 8], 32, [4, 0])]
    # the [1, 8] weight of the last layer does not split in two: rank 1's shard is empty
    assert [m["params"][2]["local_numel"] for m in metas] == [8, 0]


def test_the_fsdp2_report_names_the_fault_step_the_rank_and_the_parameter(fsdp):

    rep = build_report(str(fsdp.dirs["synced"]))
    shard = [f for f in rep.findings if f.check == "rank_divergence" and f.severity == "error"]
    assert len(shard) == 1, [f.to_dict() for f in rep.findings]
    f = shard[0]
    assert (f.step, f.rank, f.evidence["params"]) == (fr.FAULT_STEP, fr.FAULT_RANK, [fr.FAULT_PARAM])
    assert f"rank {fr.FAULT_RANK}'s shard" in f.message and fr.FAULT_PARAM in f.message
    assert f"step {fr.FAULT_STEP}" in f.message
    # every rank's loss went non-finite at that step: the all-gather spread the bad shard
    assert any(f.check == "nonfinite_loss" and f.step == fr.FAULT_STEP for f in rep.findings)


@pytest.mark.parametrize("rank", [None, 0, 1])
def test_the_fsdp2_report_s_whole_parameter_norms_equal_the_unsharded_norms(fsdp, rank):

    frames = build_report(str(fsdp.dirs["synced"]), rank=rank).frames
    rows = frames.layer_rows(0, fr.FAULT_STEP - 1)  # the healthy steps
    ref = fsdp.results[0]["synced"]  # gathered with full_tensor() in the run: the unsharded truth
    assert rows.height == fr.FAULT_STEP * 4  # one whole-parameter row per (step, parameter), any --rank
    for step, layer, gnorm, pnorm in rows.select("step", "layer", "grad_norm", "param_norm").iter_rows():
        # float32 shard norms combined in float64: equal to float32 rounding
        assert gnorm == pytest.approx(ref["ref_grad_norms"][step][layer], rel=1e-5)
        assert pnorm == pytest.approx(ref["ref_param_norms"][step][layer], rel=1e-5)


def test_ddp_ranks_each_hold_whole_parameters_so_their_rows_are_never_merged(runs):
    from analyzer.load import load_run

    plain, _ = runs
    run = load_run(plain)
    assert run.shards is None and run.meta["fsdp"] is None
    assert sorted(run.layers.select("rank").unique().collect()["rank"].to_list()) == [0, 1]


def test_with_sync_failures_every_fsdp2_rank_snapshots_into_one_dcp_directory_that_consolidates(fsdp, tmp_path):
    from tests.dist_worker import batch_for, build_model

    snaps = [_fsdp_snapshot(fsdp.dirs["synced"], r) for r in range(fr.WORLD)]
    name = schema.dcp_dir_name(fr.FAULT_STEP, "nonfinite_loss")
    for r, snap in enumerate(snaps):
        assert (snap.rank, snap.step, snap.model_state) == (r, fr.FAULT_STEP, {})
        assert (snap.fsdp["dcp_dir"], snap.fsdp["local_state"], snap.fsdp["world_size"]) == (name, None, 2)
        assert snap.fsdp["mp_policy"]["param_dtype"] == "bfloat16"
        assert torch.equal(snap.batch["x"], batch_for(r, fr.FAULT_STEP, nan_rank=-1, nan_step=-1)["x"])
    full = _consolidate(fsdp.dirs["synced"] / schema.SNAPSHOT_DIR / name, tmp_path)
    model = build_model()
    assert {k: v.shape for k, v in full["model"].items()} == {k: v.shape for k, v in model.state_dict().items()}
    # the pre-step weights: the inf rank 1 wrote into its shard sits at the whole tensor's [4, 3]
    w = full["model"][fr.FAULT_PARAM]
    assert torch.isinf(w[fr.FAULT_GLOBAL_INDEX]) and torch.isfinite(w).sum() == w.numel() - 1
    # the optimizer state dict by parameter name (SGD without momentum keeps no per-parameter state)
    assert full["optim"]["param_groups"][0]["params"] == list(model.state_dict())
    assert full["optim"]["param_groups"][0]["lr"] == 0.05


def test_without_sync_failures_each_failing_rank_saves_its_own_shards_which_tile_the_whole(fsdp, tmp_path):
    snaps = [_fsdp_snapshot(fsdp.dirs["local"], r) for r in range(fr.WORLD)]
    assert not any(p.suffix == ".dcp" for p in (fsdp.dirs["local"] / schema.SNAPSHOT_DIR).iterdir())
    for snap in snaps:
        assert snap.model_state == {} and snap.fsdp["dcp_dir"] is None
        assert snap.fsdp["layout"][fr.FAULT_PARAM] == {"shape": [8, 8], "offset": [4 * snap.rank, 0]}
    # same seed, same numerics: the two shards, stacked by offset, are the synced run's whole weight
    whole = torch.cat([s.fsdp["local_state"][fr.FAULT_PARAM] for s in snaps])
    synced = _consolidate(fsdp.dirs["synced"] / schema.SNAPSHOT_DIR / schema.dcp_dir_name(fr.FAULT_STEP,
                                                                                          "nonfinite_loss"), tmp_path)
    assert torch.equal(whole, synced["model"][fr.FAULT_PARAM])


def test_killing_one_fsdp2_rank_mid_run_leaves_every_completed_part_and_snapshot_readable(fsdp, tmp_path):
    from analyzer.load import load_run

    run_dir = fsdp.dirs["killed"]
    assert "peer_error" in fsdp.results[0]["killed"]  # rank 0 lost its peer at step KILL_STEP
    for part in sorted((run_dir / schema.TRACE_DIR).iterdir()):
        assert not part.name.startswith("."), part  # nothing was being written when rank 1 died
        assert pl.read_parquet(part).height > 0
    steps = load_run(run_dir).steps.collect()
    assert steps.group_by("rank").agg(pl.col("step").max()).sort("rank").rows() == [(0, fr.KILL_STEP - 1),
                                                                                   (1, fr.KILL_STEP - 1)]
    for r in range(fr.WORLD):
        assert _fsdp_snapshot(run_dir, r).fsdp["dcp_dir"] is not None
    full = _consolidate(run_dir / schema.SNAPSHOT_DIR / schema.dcp_dir_name(fr.FAULT_STEP, "nonfinite_loss"),
                        tmp_path)
    assert fr.FAULT_PARAM in full["model"]
    rep = build_report(str(run_dir))
    assert any(f.check == "rank_divergence" and f.rank == fr.FAULT_RANK for f in rep.findings)


def test_ranks_failing_for_different_reasons_share_one_dcp_directory_named_after_the_first_reason(fsdp):
    # rank 1's NaN batch: its loss fails; the reduce-scatter brings NaN gradients to rank 0
    sdir = fsdp.dirs["batch_nan"] / schema.SNAPSHOT_DIR
    snap0 = load_snapshot(sdir / schema.snapshot_name(fr.FAULT_STEP, 0, "nonfinite_grads"))
    snap1 = load_snapshot(sdir / schema.snapshot_name(fr.FAULT_STEP, fr.FAULT_RANK, "nonfinite_loss"))
    name = schema.dcp_dir_name(fr.FAULT_STEP, "nonfinite_loss")
    assert snap0.fsdp["dcp_dir"] == snap1.fsdp["dcp_dir"] == name and (sdir / name / ".metadata").is_file()
    # step 3: rank 0's loss fails too (a new reason: a snapshot), rank 1 is still failing (none):
    # not every rank snapshots, so rank 0 wrote its own shards, with no collective
    later = load_snapshot(sdir / schema.snapshot_name(fr.FAULT_STEP + 1, 0, "nonfinite_loss"))
    assert later.fsdp["dcp_dir"] is None and later.fsdp["local_state"]
    assert not (sdir / schema.dcp_dir_name(fr.FAULT_STEP + 1, "nonfinite_loss")).exists()


def test_a_rank_that_takes_no_snapshot_never_leaves_the_failing_rank_waiting_in_a_collective(fsdp):
    # rank 0 may take none (max_snapshots=0): rank 1 writes its own shards instead of a DCP save
    res = fsdp.results
    assert [len(res[r]["uneven"]["losses"]) for r in range(fr.WORLD)] == [fr.STEPS] * fr.WORLD  # no hang
    assert res[0]["uneven"]["snapshots"] == []
    sdir = fsdp.dirs["uneven"] / schema.SNAPSHOT_DIR
    assert sorted(p.name for p in sdir.iterdir()) == [schema.snapshot_name(fr.FAULT_STEP, fr.FAULT_RANK,
                                                                            "nonfinite_loss")]
    snap = load_snapshot(sdir / schema.snapshot_name(fr.FAULT_STEP, fr.FAULT_RANK, "nonfinite_loss"))
    assert snap.fsdp["dcp_dir"] is None
    assert snap.fsdp["local_state"][fr.FAULT_PARAM].shape == (4, 8)  # rank 1's rows 4..7


def test_bf16_ddp_report_names_the_rank_and_step_of_the_first_nan_and_the_peer_behind_rank_0s_grads(runs):
    run = runs[0].parent / "bf16"
    rep = build_report(run)
    f = next(f for f in rep.findings if f.check == "rank_divergence" and f.severity == "error")
    # rank 1's local loss is NaN at step 6; the averaged NaN gradient makes every weight NaN,
    # so rank 0's loss is NaN from step 7
    assert (f.step, f.rank) == (6, 1)
    assert f.evidence["first_nonfinite_step_per_rank"] == {0: 7, 1: 6}
    obj = json.loads(CliRunner().invoke(main, ["report", str(run), "--json", "--rank", "1"]).stdout)
    assert next(x for x in obj["findings"] if x["check"] == "nonfinite_loss")["step"] == 6
    # rank 0's own loss is finite at step 6, but DDP averaged rank 1's NaN gradients into its own
    rep0 = build_report(run, rank=0)
    g = next(x for x in rep0.findings if x.check == "nonfinite_grads")
    assert g.step == 6 and g.evidence["peer_nonfinite_loss"] == {1: 6}


def test_a_ddp_snapshot_under_torchrun_replays_on_both_ranks_and_names_rank_1s_nan_batch(runs):
    from tests.test_distributed_replay import torchrun

    _, synced = runs
    snap = synced / schema.SNAPSHOT_DIR / schema.snapshot_name(NAN_STEP, NAN_RANK, "nonfinite_loss")
    proc = torchrun(2, "replay", str(snap), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(proc.stdout)
    # DDP's own all-reduce (no hook), under FP16 autocast: the NaN was in rank 1's batch before the step
    assert d["verdict"] == "nonfinite_input" and d["distributed"]["input_ranks"] == {"batch:x": [1]}
    assert d["distributed"]["ddp"]["comm_hook"] is None and d["precision_mode"] == "autocast"

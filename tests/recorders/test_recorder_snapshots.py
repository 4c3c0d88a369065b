"""Failure-step snapshots from real failing runs: triggers, limit, contents and replay."""
from __future__ import annotations

import math

import polars as pl
import pytest
import torch

from analyzer.load import load_snapshot
from recorders import Recorder, schema
from recorders.recorder import RecorderWarning
from tests.recorders.models import (
    batches, build_dropout_mlp, build_mlp, build_overflow, mse_loss, sgd, rmse_loss, train,
)

OVERFLOW = {"factory": "tests.recorders.models:build_overflow", "factory_kwargs": {"width": 16, "gain": 1000.0},
            "loss_fn": "tests.recorders.models:mse_loss"}


def overflow_batches(scales):
    # build_overflow's first layer outputs 16000 * x per unit for inputs of x: FP16 overflows
    # from x >= 4.1. Below that the model outputs 16 * 16000 * x * 1e-3 = 256 * x, which is the
    # target, so the loss and the gradients are small and finite.
    return [{"x": torch.full((2, 16), float(k)), "y": torch.full((2, 1), 256.0 * k)} for k in scales]


def snapshot_files(run):
    return sorted((run / schema.SNAPSHOT_DIR).glob(schema.SNAPSHOT_GLOB))


def test_a_failing_fp16_step_is_snapshotted_with_its_pre_step_weights_and_replays_to_the_same_loss(tmp_path):
    model = build_overflow(width=16, gain=1000.0)
    opt = sgd(model, lr=1e-12)
    pre_step = {}

    def capture(step, opt):  # after end_step, before opt.step: the weights the forward used
        pre_step[step] = {k: v.clone() for k, v in model.state_dict().items()}

    with Recorder(tmp_path, model, **OVERFLOW, amp_dtype=torch.float16, optimizer=opt) as rec:
        losses = train(model, overflow_batches([1, 2, 3, 5, 1]), rec=rec, opt=opt,
                       amp_dtype=torch.float16, on_step=capture)
    assert [math.isfinite(v) for v in losses] == [True, True, True, False, False]

    [path] = snapshot_files(tmp_path)  # the NaN that follows at step 4 continues the same failure
    assert path.name == schema.snapshot_name(3, 0, "nonfinite_loss")
    snap = load_snapshot(path)
    assert (snap["step"], snap["reason"], snap["amp_dtype"], snap["loss"]) == (3, "nonfinite_loss", "float16", math.inf)
    assert all(torch.equal(snap["model_state"][k], v) for k, v in pre_step[3].items())
    # the optimizer then applied the non-finite gradients: the live weights are no longer these
    assert not torch.isfinite(model[1].weight).all()

    rebuilt = build_overflow(**snap["factory_kwargs"])
    rebuilt.load_state_dict(snap["model_state"])
    with torch.autocast("cpu", dtype=torch.float16):
        replayed = mse_loss(rebuilt, snap["batch"])
    assert replayed.item() == math.inf
    assert math.isfinite(mse_loss(rebuilt, snap["batch"]).item())  # FP32 does not overflow


def test_a_snapshot_reloaded_into_the_factory_gives_the_same_forward_output(tmp_path):
    model = build_dropout_mlp(width=8)
    data = batches(3)
    with Recorder(tmp_path, model, factory="tests.recorders.models:build_dropout_mlp",
                  factory_kwargs={"width": 8}, loss_fn="tests.recorders.models:mse_loss") as rec:
        train(model, data[:2], rec=rec)
        rec.begin_step(2, data[2])
        path = rec.snapshot()
    snap = load_snapshot(path)
    assert tuple(snap) == schema.SNAPSHOT_KEYS
    assert snap["reason"] == "manual" and snap["train_mode"] is True
    rebuilt = build_dropout_mlp(**snap["factory_kwargs"])
    rebuilt.load_state_dict(snap["model_state"])
    model.eval(), rebuilt.eval()
    assert torch.equal(rebuilt(data[2]["x"]), model(data[2]["x"]))
    # BatchNorm's running statistics are buffers and travel too
    assert snap["model_state"]["1.num_batches_tracked"].item() == 2


def test_the_rng_state_captured_at_begin_step_replays_dropout_exactly(tmp_path):
    model = build_dropout_mlp(p=0.5)
    data = batches(4)
    with Recorder(tmp_path, model, factory="tests.recorders.models:build_dropout_mlp",
                  loss_fn="tests.recorders.models:mse_loss") as rec:
        train(model, data[:3], rec=rec)
        rec.begin_step(3, data[3])
        live = mse_loss(model, data[3])
        live.backward()
        rec.end_step(live)
        path = rec.snapshot()
    snap = load_snapshot(path)
    rebuilt = build_dropout_mlp(p=0.5)
    rebuilt.load_state_dict(snap["model_state"])
    rebuilt.train(snap["train_mode"])
    torch.manual_seed(999)  # anything: the snapshot's state must override it
    torch.set_rng_state(snap["rng"]["cpu"])
    replayed = mse_loss(rebuilt, snap["batch"])
    assert replayed.item() == live.item() == snap["loss"]
    assert snap["rng"]["cuda"] is None  # CUDA was never initialised in this process


def test_the_snapshot_rng_state_is_get_rng_state_at_begin_step_byte_for_byte(tmp_path):
    # begin_step clones the generator and the snapshot serialises the clone: the bytes must be
    # get_rng_state()'s at begin_step, the cached normal sample included (a scalar randn fills it)
    model = build_dropout_mlp(p=0.5)
    data = batches(2)
    with Recorder(tmp_path, model) as rec:
        train(model, data[:1], rec=rec)
        torch.randn(())  # leaves a cached second Box-Muller sample in the CPU generator
        expected = torch.get_rng_state()
        rec.begin_step(1, data[1])
        torch.rand(1000)  # the step draws: the capture must not follow the live generator
        loss = mse_loss(model, data[1])
        loss.backward()
        rec.end_step(loss)
        path = rec.snapshot()
    state = load_snapshot(path)["rng"]["cpu"]
    assert state.dtype == torch.uint8 and torch.equal(state, expected)
    assert not torch.equal(torch.get_rng_state(), expected)


def test_nonfinite_gradients_without_a_scaler_trigger_a_snapshot_even_with_a_finite_loss(tmp_path):
    model = build_mlp()
    data = batches(2)
    with torch.no_grad():  # a perfect fit: RMSE is sqrt(0), whose gradient is inf * 0 = NaN
        data[0]["y"] = model(data[0]["x"])
    nonfinite = []

    def count(step, opt):
        nonfinite.append(sum(int((~torch.isfinite(p.grad)).sum()) for p in model.parameters()))
    with Recorder(tmp_path, model, factory="tests.recorders.models:build_mlp",
                  loss_fn="tests.recorders.models:rmse_loss", max_snapshots=1) as rec:
        losses = train(model, data, rec=rec, loss_fn=rmse_loss, on_step=count)
    assert losses[0] == 0.0
    [path] = snapshot_files(tmp_path)
    snap = load_snapshot(path)
    assert (snap["step"], snap["reason"]) == (0, "nonfinite_grads")
    assert snap["grad_norm"] is not None and math.isnan(snap["grad_norm"])
    steps = pl.read_parquet(tmp_path / "trace" / schema.STEPS_GLOB).sort("step")
    # the exact count: NaN everywhere except where ReLU's mask zeroes the gradient (dead units)
    assert 0 < nonfinite[0] < sum(p.numel() for p in model.parameters())
    assert steps["nonfinite_grads"][0] == nonfinite[0]


def test_a_streak_of_skipped_steps_after_the_scale_settled_snapshots_when_it_reaches_overflow_streak(tmp_path):
    # Steps 0-1 fit at a scale of 1024 (it settles there); from step 2 the targets are 1e3 away, so
    # d mse / d out ~ 500 and the scaled FP16 backward overflows although the loss is finite:
    # GradScaler skips and halves the scale every step (1024 .. 64 all still overflow).
    model = build_mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt = sgd(model)
    data = batches(2) + [{**b, "y": b["y"] + 1e3} for b in batches(5, seed=2)]
    with Recorder(tmp_path, model, factory="tests.recorders.models:build_mlp", loss_fn=mse_loss,
                  scaler=scaler, amp_dtype=torch.float16, optimizer=opt, overflow_streak=3) as rec:
        losses = train(model, data, rec=rec, opt=opt, scaler=scaler, amp_dtype=torch.float16)
    assert all(math.isfinite(v) for v in losses)
    steps = pl.read_parquet(tmp_path / "trace" / schema.STEPS_GLOB).sort("step")
    assert steps["skipped"].to_list() == [False, False] + [True] * 5
    [path] = snapshot_files(tmp_path)
    snap = load_snapshot(path)
    assert (snap["step"], snap["reason"], snap["scale"]) == (4, "overflow_streak", 256.0)
    assert math.isfinite(snap["loss"])


def test_gradscaler_start_up_calibration_writes_no_snapshot(tmp_path):
    # A scale of 2**40 makes the first FP16 backwards overflow although the loss is finite: GradScaler
    # skips and halves the scale from the start (2**40 .. 2**29 all still overflow) until the gradients
    # fit. That is its start-up calibration, however long: it spends none of the snapshot slots.
    model = build_mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    opt = sgd(model)
    with Recorder(tmp_path, model, factory="tests.recorders.models:build_mlp", loss_fn=mse_loss,
                  scaler=scaler, amp_dtype=torch.float16, optimizer=opt, overflow_streak=3) as rec:
        losses = train(model, batches(12), rec=rec, opt=opt, scaler=scaler, amp_dtype=torch.float16)
        assert not rec.snapshots
    assert all(math.isfinite(v) for v in losses)
    steps = pl.read_parquet(tmp_path / "trace" / schema.STEPS_GLOB).sort("step")
    assert steps["skipped"].to_list() == [True] * 12
    assert steps["scale"].to_list() == [2.0**e for e in range(40, 28, -1)]
    assert snapshot_files(tmp_path) == []


def test_a_scale_falling_below_min_scale_snapshots_with_the_scaler_state(tmp_path):
    # Every step overflows FP16 in forward (x=5), so the loss is inf and GradScaler halves the
    # scale each step: 4, 2, 1, 0.5, 0.25. The first step fails (nonfinite_loss); the scale
    # first drops below min_scale=1 at step 3.
    model = build_overflow()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    opt = sgd(model)
    with Recorder(tmp_path, model, **OVERFLOW, scaler=scaler, amp_dtype=torch.float16, optimizer=opt) as rec:
        train(model, overflow_batches([5] * 5), rec=rec, opt=opt, scaler=scaler, amp_dtype=torch.float16)
    steps = pl.read_parquet(tmp_path / "trace" / schema.STEPS_GLOB).sort("step")
    assert steps["scale"].to_list() == [4.0, 2.0, 1.0, 0.5, 0.25]
    assert steps["skipped"].to_list() == [True] * 5
    assert [p.name for p in snapshot_files(tmp_path)] == [
        schema.snapshot_name(0, 0, "nonfinite_loss"), schema.snapshot_name(3, 0, "scale_collapse")]
    snap = load_snapshot(tmp_path / "snapshots" / schema.snapshot_name(3, 0, "scale_collapse"))
    assert snap["scale"] == 0.5 and snap["scaler_state"]["scale"] == 0.5


def test_at_most_max_snapshots_are_written_and_manual_ones_do_not_count(tmp_path):
    model = build_mlp()
    data = batches(10)
    for step in (1, 3, 5, 7):
        data[step]["y"][0, 0] = float("inf")  # four separate non-finite losses
    scaler = torch.amp.GradScaler("cpu")
    opt = sgd(model)
    with Recorder(tmp_path, model, factory="tests.recorders.models:build_mlp", loss_fn=mse_loss,
                  scaler=scaler, amp_dtype=torch.float16, optimizer=opt, max_snapshots=2) as rec:
        train(model, data, rec=rec, opt=opt, scaler=scaler, amp_dtype=torch.float16)
        rec.snapshot("after_training")
    names = [p.name for p in snapshot_files(tmp_path)]
    # GradScaler skips each inf step, so the weights stay finite and each NaN is its own failure
    assert names == [schema.snapshot_name(1, 0, "nonfinite_loss"), schema.snapshot_name(3, 0, "nonfinite_loss"),
                     schema.snapshot_name(9, 0, "after_training")]
    assert rec.snapshots == [tmp_path / "snapshots" / n for n in names]


def test_end_step_returns_the_failure_so_a_loop_can_stop(tmp_path):
    model = build_overflow()
    rec = Recorder(tmp_path, model, **OVERFLOW, amp_dtype=torch.float16)
    results = []
    for step, batch in enumerate(overflow_batches([1, 5])):
        rec.begin_step(step, batch)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mse_loss(model, batch)
        loss.backward()
        results.append(rec.end_step(loss))
        model.zero_grad()
    rec.close()
    assert results == [None, "nonfinite_loss"]
    # the failing step reached the disk at once, before close
    assert pl.read_parquet(tmp_path / "trace" / schema.STEPS_GLOB)["step"].to_list() == [0, 1]


def test_a_run_that_stays_nan_writes_one_snapshot_and_one_part_per_failure_not_per_step(tmp_path):
    model = build_mlp()
    data = batches(10)
    data[2]["x"][0, 0] = float("nan")  # NaN from step 2 on: SGD spreads it into the weights
    with Recorder(tmp_path, model, factory="tests.recorders.models:build_mlp", loss_fn=mse_loss,
                  flush_every=100) as rec:
        losses = train(model, data, rec=rec)
    assert [math.isnan(v) for v in losses] == [False, False] + [True] * 8
    assert [p.name for p in snapshot_files(tmp_path)] == [schema.snapshot_name(2, 0, "nonfinite_loss")]
    # one part when the failure started (steps 0-2), one at close (steps 3-9)
    parts = sorted((tmp_path / "trace").glob(schema.STEPS_GLOB))
    assert [pl.read_parquet(p)["step"].to_list() for p in parts] == [[0, 1, 2], list(range(3, 10))]


def test_a_batch_that_cannot_be_snapshotted_warns_and_training_goes_on(tmp_path):
    model = build_mlp()
    batch = batches(1)[0]
    batch["meta"] = object()  # not a tensor, container or primitive
    with Recorder(tmp_path, model, factory="tests.recorders.models:build_mlp", loss_fn=mse_loss) as rec:
        rec.begin_step(0, batch)
        with pytest.warns(RecorderWarning, match=r"TypeError: batch\['meta'\] is a builtins.object"):
            assert rec.snapshot() is None
    assert rec.write_errors == 1


def test_a_manual_snapshot_before_end_step_takes_the_scale_from_the_scaler(tmp_path):
    model = build_mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    batch = batches(1)[0]
    with Recorder(tmp_path, model, factory="tests.recorders.models:build_mlp", loss_fn=mse_loss,
                  scaler=scaler, amp_dtype=torch.float16) as rec:
        rec.begin_step(0, batch)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mse_loss(model, batch)
        scaler.scale(loss).backward()
        snap = load_snapshot(rec.snapshot("before_end_step"))
    assert (snap["scale"], snap["loss"], snap["grad_norm"]) == (512.0, None, None)

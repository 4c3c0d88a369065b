"""The Recorder on CUDA: per-device statistics, CUDA RNG in snapshots, one host sync per step."""
from __future__ import annotations

import math
import warnings

import polars as pl
import pytest
import torch

from analyzer.load import load_snapshot
from recorders import Recorder, schema
from tests.recorders.models import batches, build_mlp, mse_loss, sgd, train

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REFS = {"factory": "tests.recorders.models:build_mlp", "loss_fn": "tests.recorders.models:mse_loss"}


def cuda_batches(n):
    return [{k: v.cuda() for k, v in b.items()} for b in batches(n)]


def test_an_fp16_cuda_run_records_the_skips_and_snapshots_the_cuda_rng(tmp_path):
    model = build_mlp().cuda()
    scaler = torch.amp.GradScaler("cuda")
    opt = sgd(model)
    data = cuda_batches(12)
    data[6]["y"][0, 0] = float("inf")  # a non-finite loss at step 6
    with Recorder(tmp_path, model, **REFS, scaler=scaler, amp_dtype=torch.float16, optimizer=opt) as rec:
        train(model, data, rec=rec, opt=opt, scaler=scaler, amp_dtype=torch.float16, device_type="cuda")
    steps = pl.read_parquet(tmp_path / "trace" / schema.STEPS_GLOB).sort("step")
    scales = steps["scale"].to_list()
    assert steps["skipped"].to_list()[:-1] == [scales[i + 1] < scales[i] for i in range(11)]
    assert steps["skipped"][6] and math.isinf(steps["loss"][6])
    snap = load_snapshot(tmp_path / "snapshots" / schema.snapshot_name(6, 0, "nonfinite_loss"))
    assert snap["device_type"] == "cuda"
    assert isinstance(snap["rng"]["cuda"], list) and snap["rng"]["cuda"][0].dtype == torch.uint8
    assert snap["batch"]["x"].device.type == "cpu"
    assert all(t.device.type == "cpu" for t in snap["model_state"].values())


def test_end_step_synchronises_the_host_once_per_step(tmp_path):
    model = build_mlp().cuda()
    scaler = torch.amp.GradScaler("cuda")
    opt = sgd(model)
    data = cuda_batches(4)
    syncs = []
    with Recorder(tmp_path, model, **REFS, scaler=scaler, amp_dtype=torch.float16, optimizer=opt,
                  flush_every=100) as rec:
        for step, batch in enumerate(data):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = mse_loss(model, batch)
            scaler.scale(loss).backward()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    rec.begin_step(step, batch)  # (late here, so the loop's own syncs stay unwatched)
                    rec.end_step(loss)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            if rec.last["nonfinite_grads"] == 0:  # overflowing steps take the cold path, which may sync
                syncs.append(sum("synchroniz" in str(w.message) for w in caught))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    assert syncs and all(n == 1 for n in syncs), syncs  # the one stacked .tolist() of the failure check


def test_healthy_steps_past_the_spike_warm_up_still_synchronise_the_host_once(tmp_path):
    # spike_window=10: the spike triggers judge every step from the 11th on, from the host values of the one sync
    model = build_mlp().cuda()
    opt = sgd(model)
    syncs = []
    with Recorder(tmp_path, model, **REFS, optimizer=opt, flush_every=100, spike_window=10) as rec:
        for step, batch in enumerate(cuda_batches(30)):
            loss = mse_loss(model, batch)
            loss.backward()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    rec.begin_step(step, batch)
                    rec.end_step(loss)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            syncs.append(sum("synchroniz" in str(w.message) for w in caught))
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert not rec.snapshots  # healthy: no spike snapshot, whose writing would sync
    assert syncs[12:] == [1] * 18, syncs

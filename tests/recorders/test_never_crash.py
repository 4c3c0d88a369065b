"""The recorder never takes training down: an internal error warns once, stops recording, and
training goes on with exactly the numerics it has without a recorder (FSDP2 included)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from analyzer.load import load_snapshot
from analyzer.load import load_run
from recorders import Recorder
from recorders.recorder import RecorderWarning
from tests.fsdp_runs import FAULT_RANK, FAULT_STEP, STEPS, fsdp_available, shared_fsdp_runs


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    if not fsdp_available():
        pytest.skip("needs torch.distributed.fsdp.fully_shard and DCP with gloo")
    return shared_fsdp_runs(tmp_path_factory)  # one spawn, shared with tests/test_distributed.py


def test_an_fsdp2_run_trains_every_step_with_the_recorder_attached_and_its_numerics_unchanged(fsdp_runs):
    for res in fsdp_runs.results.values():
        for name in ("synced", "local"):  # with and without the collective snapshot
            assert len(res[name]["losses"]) == STEPS
            # identical to the same rank training without a recorder (NaN compares by position)
            assert json.dumps(res[name]["losses"]) == json.dumps(res["plain"]["losses"])
            assert json.dumps(res[name]["weights"]) == json.dumps(res["plain"]["weights"])


def test_an_fsdp2_run_is_recorded_on_local_shards_without_stopping(fsdp_runs):
    for rank, res in fsdp_runs.results.items():
        assert res["warnings"] == []
        for name in ("synced", "local"):
            assert (res[name]["stopped"], res[name]["write_errors"]) == (False, 0)
            # the fault rank's inf weight is all-gathered: every rank's loss fails at FAULT_STEP
            assert res[name]["failures"][FAULT_STEP] == "nonfinite_loss"
            assert len(res[name]["snapshots"]) == 1
    snap = load_snapshot(fsdp_runs.results[FAULT_RANK]["local"]["snapshots"][0])
    assert (snap.step, snap.rank, snap.model_state) == (FAULT_STEP, FAULT_RANK, {})
    # without sync_failures: this rank's shards, plain tensors, in its own file
    assert all(type(t) is torch.Tensor for t in snap.fsdp["local_state"].values())
    steps = load_run(fsdp_runs.dirs["synced"]).steps.collect()
    assert steps.group_by("rank").len().sort("rank")["len"].to_list() == [STEPS, STEPS]


# ---------------------------------------------------------------------------- in-process failures
def _sparse_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))


def _train_sparse(rec_dir=None, steps=5):
    """A model with a sparse gradient, which the recorder's norm kernels cannot take."""
    model = _sparse_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(rec_dir, model, optimizer=opt, flush_every=2) if rec_dir is not None else None
    losses = []
    for step in range(steps):
        idx = torch.tensor([step % 10, (3 * step + 1) % 10])
        if rec is not None:
            rec.begin_step(step, {"idx": idx})
        loss = model(idx).pow(2).sum()
        loss.backward()
        if rec is not None:
            assert rec.end_step(loss) is None
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if rec is not None:
        rec.close()
    return model.state_dict(), losses, rec


def test_a_gradient_the_recorder_cannot_handle_warns_once_stops_recording_and_training_is_unchanged(tmp_path):
    plain_state, plain_losses, _ = _train_sparse()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, losses, rec = _train_sparse(tmp_path)
    warned = [w for w in caught if issubclass(w.category, RecorderWarning)]
    assert len(warned) == 1
    message = str(warned[0].message)
    assert "stopped recording" in message and "end_step" in message and "NotImplementedError" in message
    assert rec.stopped and rec.last is None
    assert losses == plain_losses
    assert all(torch.equal(state[k], plain_state[k]) for k in plain_state)


def test_a_run_directory_removed_after_start_does_not_stop_training(tmp_path):
    import shutil

    from tests.recorders.models import batches, build_mlp, train

    torch.manual_seed(5)
    plain = build_mlp()
    train(plain, batches(6))
    torch.manual_seed(5)
    model = build_mlp()
    run = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(run, model, flush_every=2) as rec:

            def pull_the_rug(step, opt):
                if step == 1:
                    shutil.rmtree(run)
                    run.write_text("a file where the run directory was")

            train(model, batches(6), rec=rec, on_step=pull_the_rug)
            rec.snapshot()
    assert len([w for w in caught if issubclass(w.category, RecorderWarning)]) == 1
    assert rec.write_errors >= 1
    assert all(torch.equal(model.state_dict()[k], plain.state_dict()[k]) for k in plain.state_dict())

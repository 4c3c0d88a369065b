"""Snapshots hold the buffers as they were at begin_step, not as the failing forward left them."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from analyzer.load import load_snapshot
from recorders import Recorder
from recorders._buffers import BufferTracker

REFS = {"factory": "tests.recorders.test_prestep_buffers:build_bn", "loss_fn": "tests.recorders.test_prestep_buffers:bn_loss"}


class WithConstant(nn.Module):
    """Linear -> BatchNorm1d -> Linear, plus a buffer no forward writes."""

    def __init__(self, width: int = 6):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, 1)
        self.register_buffer("offset", torch.full((width,), 0.5))

    def forward(self, x):
        return self.head(self.bn(self.fc(x + self.offset)))


def build_bn(width: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return WithConstant(width)


def bn_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]), batch["y"])


def _batches(n: int, nan_step: int, width: int = 6) -> list[dict]:
    g = torch.Generator().manual_seed(2)
    out = [{"x": torch.randn(8, width, generator=g), "y": torch.randn(8, 1, generator=g)} for _ in range(n)]
    out[nan_step]["x"][3, 1] = float("nan")  # BatchNorm's batch mean goes NaN, then running_mean
    return out


def _run(tmp_path, n: int, nan_step: int):
    """Train; return the snapshot and the buffers captured right before the failing step's forward."""
    model = build_bn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    before = {}
    with Recorder(tmp_path, model, **REFS, optimizer=opt) as rec:
        for step, batch in enumerate(_batches(n, nan_step)):
            if step == nan_step:
                before = {k: v.clone() for k, v in model.named_buffers()}
            rec.begin_step(step, batch)
            loss = bn_loss(model, batch)
            loss.backward()
            rec.end_step(loss)
            opt.step()
            opt.zero_grad()
    after = dict(model.named_buffers())
    return load_snapshot(rec.snapshots[0]), before, after


def _assert_pre_step(snap, before, after):
    state = snap["model_state"]
    # the forward really poisoned the live statistics...
    assert not torch.isfinite(after["bn.running_mean"]).all()
    # ...and the snapshot holds them as they were before it, bit for bit
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "offset"):
        assert torch.equal(state[name], before[name]), name
    assert torch.isfinite(state["bn.running_mean"]).all() and torch.isfinite(state["bn.running_var"]).all()


def test_a_failing_step_snapshots_the_batchnorm_statistics_from_before_its_forward(tmp_path):
    snap, before, after = _run(tmp_path, n=5, nan_step=3)
    assert snap["step"] == 3 and math.isnan(snap["loss"])
    _assert_pre_step(snap, before, after)
    assert int(snap["model_state"]["bn.num_batches_tracked"]) == 3  # three forwards before this one


def test_a_step_0_failure_snapshots_the_initial_buffers(tmp_path):
    snap, before, after = _run(tmp_path, n=2, nan_step=0)
    assert snap["step"] == 0
    _assert_pre_step(snap, before, after)
    assert torch.equal(snap["model_state"]["bn.running_mean"], torch.zeros(6))
    assert int(snap["model_state"]["bn.num_batches_tracked"]) == 0


def test_after_the_first_step_only_the_buffers_a_forward_mutates_are_copied():
    model = build_bn()
    tracker = BufferTracker(model)
    x = torch.randn(8, 6)
    tracker.begin()
    assert len(tracker.copies) == 4  # first step: every buffer, the mutated ones are not known yet
    model(x)
    tracker.end()
    watched = [tracker.names[i] for i in tracker.watch]
    assert watched == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    assert sorted(tracker.names[i] for i in tracker.copies) == sorted(watched)  # offset's copy freed
    tracker.begin()
    model(x)
    pre, missed = tracker.pre_step()
    assert sorted(pre) == sorted(watched) and missed == []


def test_an_eval_mode_forward_mutates_no_buffer_and_the_snapshot_holds_the_live_values(tmp_path):
    model = build_bn().eval()
    batch = _batches(1, 0)[0]
    rec = Recorder(tmp_path, model, **REFS)
    rec.begin_step(0, batch)
    loss = bn_loss(model, batch)
    loss.backward()
    rec.end_step(loss)
    assert rec._buffers.watch == [] and rec._buffers.copies == {}  # nothing to copy from now on
    rec.close()
    snap = load_snapshot(rec.snapshots[0])
    assert all(torch.equal(snap["model_state"][k], v) for k, v in model.named_buffers())

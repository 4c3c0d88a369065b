"""Recorder(rewind=K): the window's start state and steps round-trip through a snapshot, on real tiny runs."""
from __future__ import annotations

import pytest
import torch

from analyzer.load import load_snapshot
from recorders import Recorder, schema
from tests.analyzer.replay.window_models import build_centered, shifted_batches, train

REFS = {"factory": "tests.analyzer.replay.window_models:build_centered",
        "loss_fn": "tests.analyzer.replay.window_models:centered_loss"}


class _Weights:
    """Keeps a copy of the model's weights at each begin_step (the loop's view of the start state)."""

    def __init__(self, rec, model):
        self.rec, self.model, self.at = rec, model, {}

    def begin_step(self, step, batch):
        self.at[step] = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.rec.begin_step(step, batch)

    def __getattr__(self, name):
        return getattr(self.rec, name)


def _record(tmp_path, k=4, steps=12, snapshot_at=9, reuse_buffer=False, amp_dtype=torch.bfloat16):
    data = shifted_batches(steps)
    model = build_centered()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)  # the lr each step used is kept
    lrs = []
    opt.register_step_pre_hook(lambda o, a, kw: lrs.append(o.param_groups[0]["lr"]))
    opt.register_step_post_hook(lambda o, a, kw: sched.step())
    with Recorder(tmp_path, model, **REFS, optimizer=opt, amp_dtype=amp_dtype, rewind=k) as rec:
        watch = _Weights(rec, model)
        losses = train(model, data, opt=opt, rec=watch, amp_dtype=amp_dtype, snapshot_at=snapshot_at,
                       reuse_buffer=reuse_buffer)
    return data, losses, lrs, watch.at, rec.snapshots


def test_a_snapshot_round_trips_the_window_start_state_and_every_step_since(tmp_path):
    data, losses, lrs, weights, snaps = _record(tmp_path)
    snap = load_snapshot(snaps[0])
    rw = snap.rewind
    assert snap.format_version == schema.FORMAT_VERSION >= 8 and tuple(rw) == schema.REWIND_KEYS
    # starts at steps 0, 4, 8: at step 9 the older of the two kept is 4, K=4 or more steps before 9
    assert rw["steps_asked"] == 4 and rw["start_step"] == 4
    assert [s["step"] for s in rw["steps"]] == [4, 5, 6, 7, 8, 9]
    assert all(tuple(s) == schema.REWIND_STEP_KEYS for s in rw["steps"])
    for name, t in weights[4].items():
        assert torch.equal(rw["model_state"][name], t), name
    for s in rw["steps"]:
        assert torch.equal(s["batch"]["x"], data[s["step"]]["x"]) and torch.equal(s["batch"]["y"], data[s["step"]]["y"])
        assert s["loss"] == pytest.approx(losses[s["step"]], rel=1e-7)
        assert s["skipped"] is False  # no GradScaler: never skipped
    assert [s["optimizer_stepped"] for s in rw["steps"]] == [True] * 5 + [None]  # the snapshot's step: not yet
    # the lr each step stepped with (StepLR halves it every 3 steps), the snapshot's own step not yet stepped
    assert [s["param_groups"][0]["lr"] for s in rw["steps"][:-1]] == lrs[4:9]
    assert rw["steps"][-1]["param_groups"] is None
    assert rw["optimizer"]["class"] == "torch.optim.sgd.SGD"
    assert rw["optimizer"]["param_names"] == ["lin0.weight", "lin0.bias", "lin1.weight", "lin1.bias"]
    assert set(rw["optimizer"]["state_dict"]["state"]) == {0, 1, 2, 3}  # momentum buffers after step 3
    # the RNG state of each step is begin_step's: the state the step's forward drew from
    assert rw["steps"][-1]["rng"]["cpu"].dtype == torch.uint8


def test_batches_are_copied_so_a_loop_that_refills_one_buffer_keeps_each_steps_batch(tmp_path):
    data, _, _, _, snaps = _record(tmp_path, reuse_buffer=True)
    rw = load_snapshot(snaps[0]).rewind
    assert [torch.equal(s["batch"]["x"], data[s["step"]]["x"]) for s in rw["steps"]] == [True] * 6


@pytest.mark.parametrize("k", [1, 3, 5])
def test_every_snapshot_after_the_first_k_steps_holds_at_least_k_steps_before_it(tmp_path, k):
    model = build_centered()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = shifted_batches(4 * k + 3)
    with Recorder(tmp_path, model, **REFS, optimizer=opt, rewind=k) as rec:
        for step, batch in enumerate(data):
            rec.begin_step(step, batch)
            from tests.analyzer.replay.window_models import centered_loss

            loss = centered_loss(model, batch)
            loss.backward()
            rec.end_step(loss)
            rec.snapshot(f"at{step}")
            opt.step()
            opt.zero_grad()
    for step in range(len(data)):
        rw = load_snapshot(tmp_path / schema.SNAPSHOT_DIR / schema.snapshot_name(step, 0, f"at{step}")).rewind
        held = [s["step"] for s in rw["steps"]]
        assert held == list(range(rw["start_step"], step + 1))
        assert step - rw["start_step"] >= min(k, step) and len(held) <= 2 * k, (step, held)


def test_without_rewind_snapshots_hold_no_window(tmp_path):
    model = build_centered()
    opt = torch.optim.Adam(model.parameters())
    with Recorder(tmp_path, model, **REFS, optimizer=opt) as rec:
        train(model, shifted_batches(3), opt=opt, rec=rec, snapshot_at=2)
    assert load_snapshot(rec.snapshots[0]).rewind is None


@pytest.mark.parametrize("kwargs, match", [({"rewind": 0}, "rewind must be None or an int >= 1"),
                                           ({"rewind": 2.0}, "rewind must be None or an int >= 1"),
                                           ({"rewind": 3, "optimizer": None}, "rewind=K needs the optimizer")])
def test_a_rewind_setting_the_window_cannot_use_is_refused_at_construction(tmp_path, kwargs, match):
    model = build_centered()
    kwargs = {"optimizer": torch.optim.Adam(model.parameters()), **kwargs}
    with pytest.raises(ValueError, match=match):
        Recorder(tmp_path, model, **REFS, **kwargs)


def test_the_window_adds_no_host_read_of_a_tensor_to_a_step(tmp_path):
    from tests.recorders.test_spikes import _HostReads
    from tests.analyzer.replay.window_models import centered_loss

    def reads(d, rewind):
        model = build_centered()
        opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3))  # a tensor lr: kept, not read
        counts = []
        with Recorder(d, model, **REFS, optimizer=opt, rewind=rewind, flush_every=1000) as rec:
            for step, batch in enumerate(shifted_batches(12)):
                with _HostReads() as mode:
                    rec.begin_step(step, batch)
                    loss = centered_loss(model, batch)
                    loss.backward()
                    rec.end_step(loss)
                    opt.step()
                    opt.zero_grad()
                counts.append(mode.n)
        return counts

    on, off = reads(tmp_path / "on", 3), reads(tmp_path / "off", None)
    assert on == off and max(on) >= 1  # the reads the step already makes are seen, and no more

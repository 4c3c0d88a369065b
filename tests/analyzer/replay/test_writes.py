"""Replay knows which buffers a step only writes, and never calls them non-finite inputs.

An FP16 model whose inputs reach ~1e5 feeds them to Linear -> BatchNorm1d (pytorch/pytorch#115500):
autocast's FP16 cast of the Linear input overflows (1e5 > 65504 on every kernel: no SIMD luck),
and the train-mode BatchNorm then writes NaN into its running statistics. Those are the step's
output, not its input: replay must name the overflow, with pre-forward buffers (what the recorder
saves now) and with post-forward ones (older snapshots), built here by really running the forward.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzer.render import render_replay_text
from analyzer.replay import replay_snapshot
from analyzer.replay.runs._mode import _OpStatsMode
from analyzer.replay.runs._writes import BufferReads
from recorders.snapshot import build_snapshot, write_snapshot

from . import replay_models as rm

STATS = ["buffer:1.running_mean", "buffer:1.running_var"]


def _batches(fail_at: int, n: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(n):
        x = torch.randn(8, 4, generator=g)
        if step == fail_at:
            x = x.sign() * 1e5 + x  # every |x| > 65504: the FP16 cast gives inf on any CPU
        out.append({"x": x, "y": torch.randn(8, 1, generator=g)})
    return out


def _assert_cast_overflow_in_the_linear(r) -> None:
    assert r.verdict == "overflow"
    c = r.culprit
    assert c["op"] == "aten._to_copy"  # autocast's FP16 cast of the Linear's input: the first op to make inf
    assert (c["phase"], c["module"], c["precision"]) == ("forward", "0", "float16")
    assert c["output_kind"] == "inf" and c["shadow"]["float32"] > 65504  # finite in FP32: a range problem
    assert r.nonfinite_inputs == []
    assert r.runs["float32"]["finite"]


@pytest.mark.parametrize("fail_at", [0, 2])
def test_an_fp16_input_overflow_before_batchnorm_is_an_overflow_in_the_linear_on_a_real_run(tmp_path, fail_at):
    # step 0: the recorder has not yet seen which buffers the forward mutates; step 2: it has
    step, path = rm.train_until_failure(tmp_path, factory="build_bn_net", loss_fn="mse",
                                        batches=_batches(fail_at), amp_dtype=torch.float16)
    assert step == fail_at
    r = replay_snapshot(path)
    json.loads(json.dumps(r.to_dict(), allow_nan=False))
    assert r.reason == "nonfinite_loss"
    _assert_cast_overflow_in_the_linear(r)
    assert set(r.written_only_buffers) <= set(STATS)


def _post_forward_snapshot(tmp_path, *, train_mode: bool = True):
    """An old-style snapshot: the buffers as they were after the failing forward wrote them."""
    model = rm.build_bn_net()
    batch = _batches(0)[0]
    rng = {"cpu": torch.get_rng_state(), "cuda": None}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        model(batch["x"])  # the real forward: BatchNorm writes its NaN batch statistics
    assert not torch.isfinite(model[1].running_mean).any() and not torch.isfinite(model[1].running_var).any()
    model.train(train_mode)
    snap = build_snapshot(step=0, reason="nonfinite_loss", model=model, batch=batch, rng=rng,
                          factory=f"{rm.REF}:build_bn_net", factory_kwargs={}, loss_fn=f"{rm.REF}:mse",
                          amp_dtype=torch.float16, device_type="cpu", loss=float("nan"))
    return write_snapshot(tmp_path / "post_forward.pt", snap)


def test_nan_running_stats_saved_after_the_forward_are_written_only_not_nonfinite_inputs(tmp_path):
    r = replay_snapshot(_post_forward_snapshot(tmp_path))
    _assert_cast_overflow_in_the_linear(r)
    assert r.written_only_buffers == STATS
    assert r.to_dict()["written_only_buffers"] == STATS
    assert "only writes it" in r.summary and "buffer:1.running_mean" in r.summary
    assert "only written by the step (not a cause): buffer:1.running_mean" in render_replay_text(r)


def test_nan_running_stats_an_eval_mode_batchnorm_reads_are_nonfinite_inputs(tmp_path):
    r = replay_snapshot(_post_forward_snapshot(tmp_path, train_mode=False))
    assert r.verdict == "nonfinite_input"
    assert r.nonfinite_inputs == STATS and r.written_only_buffers == []


def _buffer_snapshot(tmp_path, name: str):
    model = rm.build_buffer_net()
    getattr(model, name).fill_(float("nan"))
    g = torch.Generator().manual_seed(0)
    snap = build_snapshot(step=3, reason="nonfinite_loss", model=model,
                          batch={"x": torch.randn(4, 4, generator=g), "y": torch.randn(4, 1, generator=g)},
                          rng={"cpu": torch.get_rng_state(), "cuda": None}, factory=f"{rm.REF}:build_buffer_net",
                          factory_kwargs={}, loss_fn=f"{rm.REF}:mse", amp_dtype=torch.bfloat16, device_type="cpu")
    return write_snapshot(tmp_path / f"{name}.pt", snap)


def test_a_nan_moving_average_the_forward_only_updates_in_place_is_written_only_and_the_step_healthy(tmp_path):
    r = replay_snapshot(_buffer_snapshot(tmp_path, "ema"))
    assert r.verdict == "healthy"
    assert r.written_only_buffers == ["buffer:ema"] and r.nonfinite_inputs == []


def test_a_nan_buffer_the_forward_subtracts_from_its_input_is_a_nonfinite_input(tmp_path):
    r = replay_snapshot(_buffer_snapshot(tmp_path, "center"))
    assert r.verdict == "nonfinite_input"
    assert r.nonfinite_inputs == ["buffer:center"] and r.written_only_buffers == []


# -- BufferReads on generated programs: a buffer is read iff its value can reach the loss -------
# Each step touches the watched buffer `b` (and a scratch tensor `t`) with real ops under the mode.
STEPS = {
    "ema": (False, lambda b, t, x, h: (b.mul_(0.9).add_(x.mean(0), alpha=0.1), h)[1]),
    "overwrite": (False, lambda b, t, x, h: (b.copy_(x.mean(0)), h)[1]),
    "via_temp": (False, lambda b, t, x, h: (b.copy_(b * 0.5 + x.mean(0)), h)[1]),
    "into_scratch": (False, lambda b, t, x, h: (t.copy_(b), h)[1]),   # read into t, t unused so far
    "scratch_to_loss": (None, lambda b, t, x, h: h + t.sum()),        # read iff t holds b's value
    "add_to_loss": (True, lambda b, t, x, h: h + b.sum()),
    "slice_to_loss": (True, lambda b, t, x, h: h + b[:2].sum()),
}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(sorted(STEPS)), min_size=1, max_size=6))
def test_a_watched_buffer_is_read_exactly_when_its_value_reaches_the_loss(program):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    w = torch.ones(4, requires_grad=True)
    b, t = torch.zeros(4), torch.zeros(4)
    reads = BufferReads({"b": b})
    expect, t_holds_b = False, False
    with _OpStatsMode(reads=reads):
        h = (x * w).sum()
        for name in program:
            effect, fn = STEPS[name]
            h = fn(b, t, x, h)
            if name == "into_scratch":
                t_holds_b = True
            expect = expect or effect is True or (effect is None and t_holds_b)
        reads.finish(h)
        h.backward()
    assert (reads.read == {"b"}) == expect
    assert math.isfinite(float(h.detach()))

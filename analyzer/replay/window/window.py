"""``replay_window``: the last K steps before a snapshot, replayed from one state in FP32 and in the run's precision.

The snapshot's ``rewind`` entry (``Recorder(rewind=K)``, ``load/_rewind.py``) holds the state at a start
step and every step from there to the snapshot's. ``--steps K`` replays the last K of them (all the window
holds when it holds fewer, and says so). When the window starts earlier, its first steps are replayed once
in the run's precision (as training ran them) to reach the state before the K steps; from that state two
trajectories run the K steps, one in FP32 and one in the run's precision (``_trajectory``), and
``result.WindowResult`` compares them.

Example (``tests/analyzer/replay/test_window.py``'s BF16 run whose lr jumped 1000x for one step)::

    >>> result = replay_window(Replay("run/snapshots/step00000101-r00000-loss_spike.pt"), 8)  # doctest: +SKIP
    >>> result.fork_step, result.part_step, result.fp32_spikes                                 # doctest: +SKIP
    (94, 101, True)
"""
from __future__ import annotations

import torch

from ...errors import AnalyzerError
from ..runs._attribution import sources_relative_to
from ..replay import Replay
from ...load import recorded_cwd
from ._trajectory import run_trajectory
from .result import (UNIT_ROUNDOFF, WindowResult, loss_noise, part_step, reproduction, rows_of, spike_check,
                     tolerance, _rel)

__all__ = ["replay_window", "require_window"]


def require_window(replay: Replay) -> dict:
    """The snapshot's validated ``rewind`` entry; AnalyzerError naming the file when it has none."""
    rw = getattr(replay.snapshot, "rewind", None)
    if rw is None:
        raise AnalyzerError("the snapshot holds no rewind window, so --steps has no earlier steps to replay",
                            path=replay.path, fix="record the run with Recorder(..., rewind=K), or replay the "
                            "snapshot's step alone (without --steps)")
    return rw


def replay_window(replay: Replay, steps: int) -> WindowResult:
    """Replay the last `steps` steps of `replay`'s snapshot's rewind window (module docstring)."""
    rw = require_window(replay)
    window = rw["steps"]
    held = len(window)
    k = min(steps, held)
    prefix, fork = window[:held - k], window[held - k:]
    notes = []
    if steps > held:
        notes.append(f"--steps {steps}: the window holds {held} step(s) (from step {window[0]['step']}, "
                     f"Recorder(rewind={rw['steps_asked']})); replayed those")
    ctx = replay.context()
    low = ctx.mode.dtype  # the run's low precision; None when it trained in FP32
    run = low or "float32"
    scaler = replay.snapshot.has_scaler
    saved = ctx.model_state
    fork_devices = [ctx.device.index or 0] if ctx.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=fork_devices), sources_relative_to(recorded_cwd(replay.snapshot)):
            state, optim = rw["model_state"], rw["optimizer"]
            if prefix:
                _, state, optim = run_trajectory(ctx, state, optim, prefix, run, scaler, update_last=True)
                ran = (f"step {prefix[0]['step']} was" if len(prefix) == 1 else
                       f"steps {prefix[0]['step']}..{prefix[-1]['step']} were")
                notes.append(f"{ran} replayed in {run} first, as training did, to reach the state before "
                             f"step {fork[0]['step']}")
            fp32, _, _ = run_trajectory(ctx, state, optim, fork, "float32", scaler)
            lowt = run_trajectory(ctx, state, optim, fork, low, scaler)[0] if low else None
    finally:
        ctx.model_state = saved  # the snapshot's own step, for any replay of it after this one
    noise = loss_noise([s["loss"] for s in window[:-1]])
    tol = tolerance(low, noise)
    parted = part_step(fp32.steps, fp32.losses, lowt.losses, tol) if lowt is not None else None
    spike = spike_check(replay.snapshot.spike, fp32, lowt, window[-1])
    return WindowResult(
        snapshot=replay.path, step=replay.snapshot.step, start_step=rw["start_step"], steps_asked=steps,
        steps_recorded=rw["steps_asked"], steps_held=held, fork_step=fork[0]["step"], precision=low, scaler=scaler,
        tolerance=tol, unit_roundoff=UNIT_ROUNDOFF.get(low) if low else None, loss_noise=noise,
        first_step_difference=_rel(lowt.losses[0], fp32.losses[0]) if lowt is not None else None,
        part_step=parted, spike=spike, rows=rows_of(fork, fp32, lowt), notes=tuple(notes),
        reproduction=reproduction(fork, lowt if lowt is not None else fp32),
        unrecorded_skips=tuple(lowt.unrecorded_skips) if lowt is not None else (),
    )

"""When is a step a failure: the snapshot triggers, as a small edge-triggered state machine.

The predicates are plain functions of host numbers (no torch), so they are tested on scripted
sequences. ``Triggers.check`` is called once per step with the values of the step's one host sync.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# The reason names are the on-disk contract's (schema), re-exported beside the triggers that fire them.
from ._spikes import SpikeWatch
from .schema import MANUAL, NONFINITE_GRADS, NONFINITE_LOSS, OVERFLOW_STREAK, PEER_FAILURE, SCALE_COLLAPSE, UPDATE
from .schema import GRAD_SPIKE, LOSS_SPIKE

__all__ = [
    "NONFINITE_LOSS",
    "NONFINITE_GRADS",
    "SCALE_COLLAPSE",
    "OVERFLOW_STREAK",
    "MANUAL",
    "PEER_FAILURE",
    "UPDATE",
    "LOSS_SPIKE",
    "GRAD_SPIKE",
    "REASONS",
    "SPIKE_REASONS",
    "StepHealth",
    "Triggers",
    "spike_watch",
]

# Automatic reasons, most telling first: when several fire on one step, the first names the snapshot.
REASONS = (NONFINITE_LOSS, NONFINITE_GRADS, SCALE_COLLAPSE, OVERFLOW_STREAK)
# Snapshot reasons that are no failure (end_step returns None for them): a finite step far above its baseline.
SPIKE_REASONS = (LOSS_SPIKE, GRAD_SPIKE)


def _finite(x: float | None) -> bool:
    return x is None or math.isfinite(x)


@dataclass(frozen=True)
class StepHealth:
    """The host-side numbers of one step that the triggers look at.

    Args:
        loss: the unscaled loss, or None when the loop did not pass one.
        grads_finite: every gradient element the recorder saw is finite.
        scale: the loss scale the step's backward used; None without an enabled GradScaler.
        grad_norm: the unscaled total gradient norm, or None (no gradients); only the spike triggers read it.
    """

    loss: float | None
    grads_finite: bool
    scale: float | None
    grad_norm: float | None = None

    @property
    def has_scaler(self) -> bool:
        return self.scale is not None

    @property
    def overflowed(self) -> bool:
        """GradScaler will skip this step: it skips exactly when it finds a non-finite gradient."""
        return self.has_scaler and not self.grads_finite


@dataclass
class Triggers:
    """Edge-triggered snapshot reasons, at most ``max_snapshots`` automatic snapshots per run.

    Each reason fires on the step its condition becomes true and re-arms once it is false
    again, so a run that stays NaN for 1000 steps gives one ``nonfinite_loss`` snapshot (its
    first step), not ``max_snapshots`` copies of the same state. ``overflow_streak`` fires
    on the step where the run of consecutive overflowing (skipped) steps reaches ``streak``,
    counted only once the scale has settled.

    NB: GradScaler's start-up calibration is not a failure. Its default ``init_scale`` (65536) is
    above FP16's max, so an FP16 run usually skips its first steps while the scale backs off to
    one its gradients fit; ten or more such skips are normal. The scale has *settled* at the
    first step that is not skipped, or once it falls to 1 or below (no calibration goes that low: the
    gradients overflow unscaled). Skips before that never count toward ``overflow_streak``, so
    start-up calibration spends no snapshot; ``scale_collapse`` and the non-finite reasons fire
    during it as always.

    Spikes (``spikes``, a ``_spikes.SpikeWatch``, or None: off) are snapshot reasons, not failures: they
    never enter ``holding``, have their own cap ``max_spike_snapshots`` (so spikes never use up the
    snapshot a later NaN needs), and a step whose failure reason is snapshotted writes no spike
    snapshot. ``spike`` holds the evidence of the spike the last ``check`` returned, else None.

    Example:
        >>> t = Triggers(min_scale=1.0, streak=2, max_snapshots=3)
        >>> [t.check(StepHealth(loss, True, 4.0)) for loss in (1.0, float("nan"), float("nan"), 2.0)]
        [None, 'nonfinite_loss', None, None]
    """

    min_scale: float = 1.0
    streak: int = 8
    max_snapshots: int = 3
    fired: int = 0
    overflow_run: int = 0
    settled: bool = False  # a step was not skipped, or the scale fell to 1 or below (see the NB above)
    holding: list = field(default_factory=list)  # reasons whose condition holds at the last step
    _active: set = field(default_factory=set)
    spikes: SpikeWatch | None = None
    max_spike_snapshots: int = 2
    spikes_fired: int = 0
    spike: dict | None = None  # the evidence of the spike snapshot the last check returned

    def __post_init__(self):
        if not self.min_scale >= 0:
            raise ValueError(f"min_scale must be >= 0, got {self.min_scale!r}")
        if not (isinstance(self.streak, int) and self.streak >= 1):
            raise ValueError(f"overflow_streak must be an int >= 1, got {self.streak!r}")
        if not (isinstance(self.max_snapshots, int) and self.max_snapshots >= 0):
            raise ValueError(f"max_snapshots must be an int >= 0, got {self.max_snapshots!r}")
        if not (isinstance(self.max_spike_snapshots, int) and self.max_spike_snapshots >= 0):
            raise ValueError(f"max_spike_snapshots must be an int >= 0, got {self.max_spike_snapshots!r}")

    def conditions(self, h: StepHealth) -> list[str]:
        """Every reason whose condition holds for this step (no edge logic, no limit)."""
        if h.has_scaler and (not h.overflowed or h.scale <= 1.0):
            self.settled = True
        self.overflow_run = self.overflow_run + 1 if h.overflowed and self.settled else 0
        out = []
        if not _finite(h.loss):
            out.append(NONFINITE_LOSS)
        if not h.has_scaler and not h.grads_finite:
            out.append(NONFINITE_GRADS)
        if h.has_scaler and h.scale < self.min_scale:
            out.append(SCALE_COLLAPSE)
        if self.overflow_run >= self.streak:
            out.append(OVERFLOW_STREAK)
        return out

    def check(self, h: StepHealth) -> str | None:
        """Update the state with one step; return the reason to snapshot it for, or None."""
        holding = self.conditions(h)
        new = [r for r in holding if r not in self._active]
        self._active = set(holding)
        self.holding = holding
        # NB: updated on every step (the baselines), whatever else fires
        spike = self.spikes.check(h.loss, h.grad_norm) if self.spikes is not None else None
        self.spike = None
        if new and self.fired < self.max_snapshots:
            self.fired += 1
            return new[0]
        if spike is None or self.spikes_fired >= self.max_spike_snapshots:
            return None
        self.spikes_fired += 1
        self.spike = spike
        return spike["reason"]

    @property
    def exhausted(self) -> bool:
        return self.fired >= self.max_snapshots


def spike_watch(config) -> SpikeWatch | None:
    """The ``SpikeWatch`` of a ``_meta.RecorderConfig``, or None when both spike triggers are off."""
    if config.loss_spike is None and config.grad_spike is None:
        return None
    return SpikeWatch(loss_factor=config.loss_spike, grad_factor=config.grad_spike, window=config.spike_window)

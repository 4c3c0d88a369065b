"""What ``replay --steps K`` found: two trajectories through the window, where they part, whether FP32 spikes.

The two trajectories (FP32 and the run's precision) start from the same state and see the same batches,
RNG and hyperparameters; they differ only by the precision of their arithmetic. They *part* at the first
step whose losses differ by more than the tolerance (``tolerance``):

    tol = max(8 u, noise / 2)

- ``u`` is the unit roundoff of the run's dtype (BF16 2^-8 = 0.39%, FP16 2^-11 = 0.049%). One forward in
  low precision rounds every op's output to a relative u; a loss built from many such roundings lands
  within a few u of FP32's from the same weights (the first replayed step measures it:
  ``first_step_difference``). Below 8 u (BF16 3.1%, FP16 0.39%) a difference is one step's rounding, not two
  trajectories that went different ways.
- ``noise`` is the median relative change of the recorded loss from one step to the next over the window
  (the failing step left out): what the next batch moves the loss by anyway. A difference under half of it
  cannot be seen in the run's loss curve.

A loss that is finite in one trajectory and NaN/Inf in the other parts them at once; both NaN/Inf is no
parting (both failed). FP32 *spikes* when its value of the spike's metric (loss or gradient norm) at the
snapshot's step is above the threshold the Recorder's trigger used (``snapshot['spike']['threshold']``,
from the baseline before the spike) or not finite.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from ._trajectory import Trajectory

__all__ = ["WindowResult", "UNIT_ROUNDOFF", "tolerance", "part_step"]

UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}
ROUNDINGS = 8  # a loss within 8 unit roundoffs of FP32's is one forward's rounding


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _rel(a: float, b: float) -> float:
    """|a - b| relative to |b| (FP32's), inf when exactly one is not finite, 0 when both are equal."""
    if not (_finite(a) and _finite(b)):
        return 0.0 if not _finite(a) and not _finite(b) else math.inf
    return abs(a - b) / max(abs(b), 1e-30) if a != b else 0.0


def loss_noise(recorded: list[float | None]) -> float:
    """The median relative step-to-step change of the recorded losses (0 with fewer than 3 finite ones)."""
    vals = [v for v in recorded if _finite(v)]
    changes = [abs(b - a) / abs(a) for a, b in zip(vals, vals[1:]) if a != 0]
    return median(changes) if len(changes) >= 2 else 0.0


def tolerance(dtype: str | None, noise: float) -> float:
    """max(8 u, noise / 2): see the module docstring."""
    return max(ROUNDINGS * UNIT_ROUNDOFF.get(dtype or "float32", 2.0**-24), noise / 2)


def part_step(steps: list[int], fp32: list[float], low: list[float], tol: float) -> int | None:
    """The first step whose losses differ beyond `tol` (or are finite in one trajectory only), else None."""
    for step, a, b in zip(steps, low, fp32):
        if _rel(a, b) > tol:
            return step
    return None


@dataclass(frozen=True)
class WindowResult:
    """The window replay of one snapshot (``replay_window``); ``to_dict()`` is ``replay --json``'s ``window``."""

    snapshot: str
    step: int
    start_step: int
    steps_asked: int          # --steps K
    steps_recorded: int       # Recorder(rewind=K) of the run
    steps_held: int           # steps the window holds, the snapshot's included
    fork_step: int            # the first step of the two trajectories
    precision: str | None     # the run's low precision (None: it trained in FP32)
    scaler: bool
    tolerance: float
    unit_roundoff: float | None
    loss_noise: float
    first_step_difference: float | None
    part_step: int | None
    spike: dict | None        # metric, threshold, recorded, fp32, low, fp32_spikes, low_spikes
    rows: list[dict] = field(default_factory=list)
    notes: tuple[str, ...] = ()
    reproduction: float | None = None  # the largest relative difference of the run-precision replay's losses
    unrecorded_skips: tuple[int, ...] = ()

    @property
    def fp32_spikes(self) -> bool | None:
        return None if self.spike is None else self.spike["fp32_spikes"]

    def to_dict(self) -> dict:
        """Strict JSON: non-finite numbers as strings (``"nan"``, ``"inf"``)."""
        return _json({
            "snapshot": self.snapshot, "step": self.step, "start_step": self.start_step,
            "steps_asked": self.steps_asked, "steps_recorded": self.steps_recorded, "steps_held": self.steps_held,
            "fork_step": self.fork_step, "precision": self.precision, "scaler": self.scaler,
            "tolerance": self.tolerance, "unit_roundoff": self.unit_roundoff, "loss_noise": self.loss_noise,
            "first_step_difference": self.first_step_difference, "part_step": self.part_step,
            "fp32_spikes": self.fp32_spikes, "spike": self.spike, "rows": self.rows, "notes": list(self.notes),
            "reproduction": self.reproduction, "unrecorded_skips": list(self.unrecorded_skips),
        })


def _json(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json(v) for v in obj]
    return obj


def spike_check(spike: dict | None, fp32: Trajectory, low: Trajectory | None, recorded: dict) -> dict | None:
    """FP32's (and the run precision's) value of the spike's metric at the snapshot's step against its threshold."""
    if spike is None or not _finite(spike.get("threshold")):
        return None
    metric = spike.get("metric")
    pick = (lambda t: t.grad_norms[-1]) if metric == "grad_norm" else (lambda t: t.losses[-1])
    thr = float(spike["threshold"])

    def spikes(v: float) -> bool:
        return not _finite(v) or v > thr

    out = {"metric": "grad_norm" if metric == "grad_norm" else "loss", "threshold": thr,
           "recorded": recorded.get("grad_norm" if metric == "grad_norm" else "loss"),
           "fp32": pick(fp32), "fp32_spikes": spikes(pick(fp32)), "low": None, "low_spikes": None}
    if low is not None:
        out["low"], out["low_spikes"] = pick(low), spikes(pick(low))
    return out


def rows_of(window: list[dict], fp32: Trajectory, low: Trajectory | None) -> list[dict]:
    """Per replayed step: the recorded values beside each trajectory's."""
    rows = []
    for i, s in enumerate(window):
        row = {"step": s["step"], "recorded_loss": s["loss"], "recorded_grad_norm": s["grad_norm"],
               "recorded_scale": s["scale"], "recorded_skipped": s["skipped"],
               "fp32_loss": fp32.losses[i], "fp32_grad_norm": fp32.grad_norms[i], "fp32_stepped": fp32.stepped[i]}
        if low is not None:
            row.update({"low_loss": low.losses[i], "low_grad_norm": low.grad_norms[i], "low_scale": low.scales[i],
                        "low_stepped": low.stepped[i], "difference": _rel(low.losses[i], fp32.losses[i])})
        rows.append(row)
    return rows


def reproduction(window: list[dict], run: Trajectory) -> float | None:
    """The largest relative difference between the run-precision replay's losses and the recorded ones (steps of
    one batch only: of micro-batches, the loop passes end_step the loss it chooses, not necessarily their sum)."""
    diffs = [_rel(r, s["loss"]) for s, r in zip(window, run.losses)
             if s["loss"] is not None and s["micro_batches"] is None]
    return max(diffs) if diffs else None

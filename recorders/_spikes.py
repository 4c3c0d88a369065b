"""Loss and gradient-norm spikes against a robust trailing baseline, on host floats only.

``SpikeWatch.check`` is called once per step with the loss and total gradient norm that the step's
one host sync already brought to the host (``_stats.StepStats._record``): it reads no tensor and
adds no sync. Per metric it keeps the log of the last ``window`` finite, positive values, in
arrival order and sorted, so the baseline costs two ``bisect`` operations per step.

A value spikes when its log exceeds the baseline's median by more than both
``log(factor)`` (the value is at least `factor` times the median) and ``SPIKE_Z`` robust standard
deviations of the step-to-step noise: a run whose loss is noisy needs a larger jump than a smooth one.
The noise is measured on the differences of consecutive logs (their median absolute value / 0.954,
the standard deviation for Gaussian noise), not on the logs themselves: a loss falling fast early
in training spreads the logs of a window widely, not their differences. Logs, because loss and
gradient noise is multiplicative: a loss of 0.01 that jumps to 0.05 is as telling as 1.0 to 5.0.

- Warm-up: no spike before the baseline holds ``max(MIN_BASELINE, window // 2)`` values.
- Edge and refractory period: a metric fires on the first step of a spike, then not again until
  its value has fallen back under the threshold and ``window`` steps have passed since it fired, so one
  instability (a jump, then a climb) spends one snapshot, not one per step.
- The spiking values enter the baseline like any other: a loss that jumps and stays high
  becomes the new baseline after about ``window / 2`` steps.
- Non-finite, zero or negative values are skipped (the non-finite reasons cover the first; a loss
  that can be <= 0 has no log scale: its spikes are not watched).
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

from .schema import GRAD_SPIKE, LOSS_SPIKE

__all__ = ["SPIKE_Z", "MIN_BASELINE", "Baseline", "SpikeWatch", "warmup_of"]

SPIKE_Z = 7.0      # robust standard deviations of the step-to-step log noise above the median
MIN_BASELINE = 10  # the fewest values any baseline needs before it judges a step


def warmup_of(window: int) -> int:
    """Values a baseline of `window` needs before a spike can fire."""
    return max(MIN_BASELINE, window // 2)


class Baseline:
    """The last `window` values, in arrival order and sorted: median and IQR in O(log n) + a memmove."""

    def __init__(self, window: int):
        self.window = window
        self._fifo: deque[float] = deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._fifo)

    def add(self, v: float) -> None:
        if len(self._fifo) >= self.window:
            old = self._fifo.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._fifo.append(v)
        bisect.insort(self._sorted, v)

    def median(self) -> float:
        """The median of the values held; needs at least one."""
        s, n = self._sorted, len(self._sorted)
        return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


@dataclass
class _Metric:
    reason: str
    factor: float
    base: Baseline
    diffs: Baseline  # |log x_t - log x_(t-1)| of consecutive accepted values
    last: float | None = None  # the last accepted log value
    above: bool = False      # the last value was over the threshold
    last_fired: int | None = None  # the step count at which this metric last fired


class SpikeWatch:
    """Per-step spike detection for the loss and the gradient norm (either may be off: factor None).

    Example:
        >>> w = SpikeWatch(loss_factor=3.0, grad_factor=None, window=20)
        >>> [w.check(1.0 + 0.01 * (i % 3), None) for i in range(12)][-1] is None
        True
        >>> w.check(5.0, None)["reason"]
        'loss_spike'
    """

    def __init__(self, *, loss_factor: float | None, grad_factor: float | None, window: int,
                 loss_reason: str = LOSS_SPIKE, grad_reason: str = GRAD_SPIKE, z: float = SPIKE_Z):
        self.window = window
        self.z = z
        self.warmup = warmup_of(window)
        self._n = 0
        self._metrics = [(_Metric(r, f, Baseline(window), Baseline(window)) if f is not None else None)
                         for r, f in ((loss_reason, loss_factor), (grad_reason, grad_factor))]

    def check(self, loss: float | None, grad_norm: float | None) -> dict | None:
        """Update the baselines with one step; the first metric that starts a spike here, as evidence
        (``reason``, ``metric``, ``value``, ``baseline``, ``ratio``, ``spread``, ``threshold``, ``window``),
        or None. Both metrics are always updated."""
        self._n += 1
        hit = None
        for m, x, name in zip(self._metrics, (loss, grad_norm), ("loss", "grad_norm")):
            if m is None:
                continue
            found = self._one(m, x, name)
            if hit is None:
                hit = found
        return hit

    def _one(self, m: _Metric, x: float | None, name: str) -> dict | None:
        if x is None or not (isinstance(x, float) and math.isfinite(x) and x > 0):
            return None  # skipped: no log; nothing enters the baseline
        v = math.log(x)
        out = None
        over = False
        if len(m.base) >= self.warmup:
            med, spread = m.base.median(), m.diffs.median() / 0.954
            limit = max(math.log(m.factor), self.z * spread)
            over = v - med > limit
            rested = m.last_fired is None or self._n - m.last_fired >= self.window
            if over and not m.above and rested:
                m.last_fired = self._n
                out = {"reason": m.reason, "metric": name, "value": x, "baseline": math.exp(med),
                       "ratio": math.exp(v - med), "spread": spread, "threshold": math.exp(med + limit),
                       "factor": m.factor, "z": self.z, "window": len(m.base)}
        m.above = over
        m.base.add(v)
        if m.last is not None:
            m.diffs.add(abs(v - m.last))
        m.last = v
        return out

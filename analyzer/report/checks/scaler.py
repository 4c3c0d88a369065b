"""Loss-scale checks: ``scale_collapse``, ``frequent_overflow`` and ``startup_calibration``.

GradScaler halves the scale on every step whose gradients overflow and doubles it after
``growth_interval`` clean steps (2000 by default). In a healthy FP16 run the scale therefore
settles where about one step per growth interval overflows, after a few skips at the start
(65536 is above FP16's max of 65504, so the first backward often overflows).

Real output (``tests/analyzer/report/report_models.build_attn``: attention logits not divided by
sqrt(d), FP16, Adam at lr=1.0, 50 steps)::

    scale_collapse @ step 1: the loss scale fell from 65536 to 1 in 16 backoffs by step 24, then
    to 5.96e-08, and never recovered (41 of 49 steps skipped since step 1): 25 of the 26 steps at a
    scale of 1 or below were still skipped: on those the gradients overflow even unscaled; usual
    causes: a learning rate too high, or activations or gradients that grow past FP16's range; ...
        evidence: step_start=1 scale_start=6.554e+04 step_reached=24 scale_reached=1 ...

``startup_calibration`` names the skips GradScaler makes at the start of a run while the scale
backs off from ``init_scale`` to one the gradients fit: the leading skipped steps, before the first
step taken at a settled scale (the recorder's ``overflow_streak`` trigger ignores them the same way).
Real output (``tests/analyzer/autopsy/gnll_models``, FP16, ``GradScaler("cpu")`` at its default 65536)::

    startup_calibration @ step 0: steps 0-10 were skipped while GradScaler backed off from 65536 to 32
    in 11 backoffs before its first finite step: GradScaler's start-up calibration, normal for FP16 ...

How to read it: ``step_start`` is where the falling scale began (plateaus of up to
``MAX_PLATEAU`` clean steps inside the descent are crossed), ``step_reached`` where it passed 1.
A step still skipped at a scale of 1 or below has inf/NaN gradients even *unscaled*: no loss
scale helps it, the forward or backward itself overflows.
"""
from __future__ import annotations

import numpy as np
import polars as pl

from ...findings import Finding
from . import _stats as stats
from .frames import Frames

__all__ = ["scale_collapse", "frequent_overflow", "startup_calibration", "calibration_end", "collapse_start"]

COLLAPSE_SCALE = 1.0      # "about 1 or below": an FP16 gradient then overflows unscaled
RECOVERED_SCALE = 1024.0  # back to a useful scale: the collapse was transient
MAX_PLATEAU = 20        # clean steps the scale may hold inside one descent
FAR_ABOVE = 4.0         # equilibrium is ~1-2 skips per growth interval; 4x that is "far above"
# NB: no model-specific cause here (attention logits, residual scaling): the trace cannot tell
# which ops the model has; the replay names the op, and its advice checks the model's own ops.
_CAUSES = ("usual causes: a learning rate too high, or activations or gradients that grow past FP16's "
           "range; run 'analyzer replay' on the snapshot to find the op that overflows")


def _scales(frames: Frames) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    df = frames.steps.filter(pl.col("scale").is_not_null())
    skipped = df["skipped"].fill_null(False).to_numpy() if "skipped" in df.columns else np.zeros(df.height, bool)
    return df["step"].to_numpy(), df["scale"].to_numpy().astype(float), skipped


def collapse_start(frames: Frames) -> int | None:
    """Step where the descent into a collapsed scale began, or None (shared with frequent_overflow)."""
    f = _collapse(frames)
    return None if f is None else f["step_start"]


def _collapse(frames: Frames) -> dict | None:
    steps, scale, skipped = _scales(frames)
    low = np.flatnonzero(scale <= COLLAPSE_SCALE)
    if not low.size:
        return None
    i_low = int(low[0])
    i0 = i_low
    while i0 > 0:  # walk back down the falling scale, across short plateaus (finite steps in between)
        if scale[i0 - 1] > scale[i0]:
            i0 -= 1
            continue
        p = i0 - 1
        while p > 0 and scale[p - 1] == scale[i0]:
            p -= 1
        if scale[i0 - 1] != scale[i0] or i0 - p > MAX_PLATEAU or p == 0 or scale[p - 1] < scale[i0]:
            break  # the scale grew, or held long enough to count as stable: the descent starts here
        i0 = p
    backoffs = int(np.sum(np.diff(scale[i0:i_low + 1]) < 0))
    after = scale[i_low:]
    low_skipped = skipped[i_low:]
    run, best = 0, 0
    for s in skipped[i0:]:
        run = run + 1 if s else 0
        best = max(best, run)
    return {"step_start": int(steps[i0]), "scale_start": float(scale[i0]),
            "step_reached": int(steps[i_low]), "scale_reached": float(scale[i_low]),
            "min_scale": float(after.min()), "final_scale": float(scale[-1]),
            "backoffs": backoffs, "longest_skip_streak": best,
            "skipped_after_start": int(skipped[i0:].sum()), "steps_after_start": int(len(scale) - i0),
            "skipped_at_or_below_1": int(low_skipped[after <= COLLAPSE_SCALE].sum()),
            "steps_at_or_below_1": int((after <= COLLAPSE_SCALE).sum()),
            "recovered": bool(after.max() >= RECOVERED_SCALE and scale[-1] >= RECOVERED_SCALE)}


def scale_collapse(frames: Frames) -> list[Finding]:
    """The scale fell persistently (consecutive backoffs, no recovery) to about 1 or below."""
    ev = _collapse(frames)
    if ev is None:
        return []
    if ev["recovered"]:
        return [Finding("scale_collapse", "warning", ev["step_start"],
                        f"the loss scale fell from {ev['scale_start']:g} to {ev['min_scale']:.3g} "
                        f"but recovered to {ev['final_scale']:g}: a burst of overflowing steps; {_CAUSES}", ev)]
    # `backoffs` counts the halvings down to the first scale <= 1 (step_reached), not to the minimum
    fell = f"to {ev['scale_reached']:.3g} in {ev['backoffs']} backoffs by step {ev['step_reached']}"
    if ev["min_scale"] < ev["scale_reached"]:
        fell += f", then to {ev['min_scale']:.3g},"
    k, n = ev["skipped_at_or_below_1"], ev["steps_at_or_below_1"]
    if k == n:
        unscaled = f"every one of the {n} steps at a scale of 1 or below was skipped: the gradients overflow even unscaled"
    elif k:
        unscaled = (f"{k} of the {n} steps at a scale of 1 or below were still skipped: on those the gradients "
                    "overflow even unscaled")
    else:
        unscaled = f"no step at a scale of 1 or below was skipped, yet the scale never grew back above {RECOVERED_SCALE:g}"
    return [Finding(
        "scale_collapse", "error", ev["step_start"],
        f"the loss scale fell from {ev['scale_start']:g} {fell} and never recovered ({ev['skipped_after_start']} "
        f"of {ev['steps_after_start']} steps skipped since step {ev['step_start']}): {unscaled}; {_CAUSES}",
        ev)]


def calibration_end(frames: Frames) -> dict | None:
    """GradScaler's start-up calibration: the leading skipped steps before the first step it did not skip.

    Returns None when the first recorded step was not skipped, or when the leading skips reach a
    scale of 1 or below (no calibration goes that low: the gradients overflow unscaled, which
    ``scale_collapse`` reports). ``last_step`` is the last calibration step; ``settled`` says
    whether a step at the settled scale was recorded (False: the trace ends still calibrating).
    """
    steps, scale, skipped = _scales(frames)
    n = 0
    while n < len(steps) and skipped[n] and scale[n] > COLLAPSE_SCALE:
        n += 1
    if n == 0 or (n < len(steps) and skipped[n]):
        return None
    settled = n < len(steps)
    end_scale = float(scale[n]) if settled else float(scale[n - 1]) / 2
    with np.errstate(invalid="ignore"):  # an inf or NaN scale in a damaged trace: inf - inf is no backoff
        backoffs = int(np.sum(np.diff(scale[:n + 1] if settled else scale[:n]) < 0)) + (0 if settled else 1)
    return {"first_step": int(steps[0]), "last_step": int(steps[n - 1]), "skipped": n,
            "scale_start": float(scale[0]), "last_skipped_scale": float(scale[n - 1]), "settled_scale": end_scale,
            "settled": settled, "backoffs": backoffs}


def startup_calibration(frames: Frames) -> list[Finding]:
    """The skips of GradScaler's start-up calibration, named as such: normal for FP16, not a failure."""
    ev = calibration_end(frames)
    if ev is None:
        return []
    span = f"step {ev['first_step']} was" if ev["skipped"] == 1 else f"steps {ev['first_step']}-{ev['last_step']} were"
    if ev["settled"]:
        how = (f"backed off from {ev['scale_start']:g} to {ev['settled_scale']:g} in {ev['backoffs']} backoffs "
               "before its first finite step")
    else:
        how = f"backed off from {ev['scale_start']:g}, and the trace ends before its first finite step"
    return [Finding(
        "startup_calibration", "info", ev["first_step"],
        f"{span} skipped while GradScaler {how}: GradScaler's start-up calibration (this run's scaled "
        f"gradients overflowed at {_scale_words(ev)}); normal for FP16, not a failure", ev)]


def _scale_words(ev: dict) -> str:
    """What was measured: the scales at which this run's first steps overflowed."""
    if ev["last_skipped_scale"] == ev["scale_start"]:
        return f"scale {ev['scale_start']:g}"
    return f"every scale from {ev['scale_start']:g} down to {ev['last_skipped_scale']:g}"


def _warmup_end(steps: np.ndarray, skipped: np.ndarray, clean: int = 10, cap: int = 50) -> int:
    """Index where the start-up skips end: the first run of `clean` clean steps (within `cap`)."""
    n = len(skipped)
    limit = min(n, cap)
    for i in range(limit):
        if not skipped[i:i + clean].any():
            return i
    return limit


def frequent_overflow(frames: Frames) -> list[Finding]:
    """Skipped steps far above ~1 per growth interval, after the start-up skips (binomial test)."""
    # a step with a NaN/Inf loss is always skipped: nonfinite_loss reports those, not this check
    df = frames.steps.filter(pl.col("skipped").is_not_null() & (pl.col("loss").is_finite() | pl.col("loss").is_null()))
    if df.height == 0:
        return []
    stop = collapse_start(frames)
    if stop is not None:  # the collapse is reported by scale_collapse; judge the run before it
        df = df.filter(pl.col("step") < stop)
    skipped = df["skipped"].to_numpy()
    n_iter = df["n_iter"].to_numpy() if "n_iter" in df.columns else np.ones(df.height, np.int64)
    n_skip = df["n_skipped"].to_numpy() if "n_skipped" in df.columns else skipped.astype(np.int64)
    w = _warmup_end(df["step"].to_numpy(), skipped)
    n, k = int(n_iter[w:].sum()), int(n_skip[w:].sum())
    gi = frames.growth_interval
    expected = n / gi
    if n == 0 or k < 5 or k < FAR_ABOVE * max(expected, 1.0):
        return []
    p = stats.binom_sf(k, n, 1.0 / gi)
    if p > 1e-3:
        return []
    first = int(df["step"][w:].filter(df["skipped"][w:])[0])
    rate = k / n
    ev = {"skipped": k, "steps": n, "skip_rate": rate, "expected_skips": expected,
          "growth_interval": gi, "startup_skips": int(n_skip[:w].sum()), "binomial_p": p}
    sev = "error" if rate >= 0.5 else "warning"
    return [Finding(
        "frequent_overflow", sev, first,
        f"{k} of {n} steps were skipped for overflow ({rate:.1%}), {k / max(expected, 1e-9):.0f}x the "
        f"~{expected:.2g} a growth interval of {gi} implies (p={p:.1e}): the scale keeps hitting "
        "FP16's range; look for activations or gradients near 65504 (large logits, missing "
        "normalisation) or lower the learning rate", ev)]

"""Loss-scale checks: ``scale_collapse`` and ``frequent_overflow``.

GradScaler halves the scale on every step whose gradients overflow and doubles it after
``growth_interval`` clean steps (2000 by default). In a healthy FP16 run the scale therefore
settles where about one step per growth interval overflows, after a few skips at the start
(65536 is above FP16's max of 65504, so the first backward often overflows).

Real output (``tests/analyzer/report/report_models.build_attn``: attention logits not divided by
sqrt(d), FP16, Adam at lr=1.0, 50 steps)::

    scale_collapse @ step 1: the loss scale fell from 65536 to 1 in 16 backoffs by step 23, then
    to 1.49e-08, and never recovered (43 of 49 steps skipped since step 1): gradients overflow on
    every step, even unscaled; usual causes: a learning rate too high, residual connections missing
    or not scaled, attention logits not divided by sqrt(d_head); run 'analyzer replay' on the ...
        evidence: step_start=1 scale_start=6.554e+04 step_reached=23 scale_reached=1 ...

How to read it: ``step_start`` is where the falling scale began (plateaus of up to
``MAX_PLATEAU`` clean steps inside the descent are crossed), ``step_reached`` where it passed 1. A scale that keeps halving below 1 means even *unscaled* gradients are inf/NaN:
no loss scale can help, the forward itself overflows.
"""
from __future__ import annotations

import numpy as np
import polars as pl

from ...findings import Finding
from . import _stats as stats
from .frames import Frames

__all__ = ["scale_collapse", "frequent_overflow", "collapse_start"]

COLLAPSE_SCALE = 1.0      # "about 1 or below": an FP16 gradient then overflows unscaled
RECOVERED_SCALE = 1024.0  # back to a useful scale: the collapse was transient
MAX_PLATEAU = 20        # clean steps the scale may hold inside one descent
FAR_ABOVE = 4.0         # equilibrium is ~1-2 skips per growth interval; 4x that is "far above"
_CAUSES = ("usual causes: a learning rate too high, residual connections missing or not scaled, "
           "attention logits not divided by sqrt(d_head); run 'analyzer replay' on the snapshot "
           "to find the op that overflows")


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
    run, best = 0, 0
    for s in skipped[i0:]:
        run = run + 1 if s else 0
        best = max(best, run)
    return {"step_start": int(steps[i0]), "scale_start": float(scale[i0]),
            "step_reached": int(steps[i_low]), "scale_reached": float(scale[i_low]),
            "min_scale": float(after.min()), "final_scale": float(scale[-1]),
            "backoffs": backoffs, "longest_skip_streak": best,
            "skipped_after_start": int(skipped[i0:].sum()), "steps_after_start": int(len(scale) - i0),
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
    return [Finding(
        "scale_collapse", "error", ev["step_start"],
        f"the loss scale fell from {ev['scale_start']:g} {fell} and never recovered ({ev['skipped_after_start']} "
        f"of {ev['steps_after_start']} steps skipped since step {ev['step_start']}): gradients overflow on every "
        f"step, even unscaled; {_CAUSES}",
        ev)]


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

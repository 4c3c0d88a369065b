"""Runs that do not learn: ``tiny_updates`` (the weights move far less than the optimizer's rule says)
and ``flat_loss`` (the loss has not moved from its start).

- ``tiny_updates`` (warning): for each parameter, the measured change of its weights between two
  recorded rows (``update_rms``, on the fixed sample, since format 3) against the per-step update the
  recorded optimizer's rule implies for the recorded gradient and lr: plain SGD moves an element by
  ``lr x gradient`` (its RMS: ``lr x grad_norm / sqrt(numel)``), the Adam family by about ``lr`` per
  element (``m / (sqrt(v) + eps)`` is of order 1), less where eps dominates (``lr x g / (g + eps)``,
  ``g`` the gradient's RMS). A parameter whose median ratio, over at least ``MIN_ROWS`` recorded rows,
  is below ``RATIO`` (1000x smaller) is flagged. Momentum, weight decay and a row that spans
  several steps (``layer_every``) only make the measured change larger, so the comparison can only
  under-flag. Rows judged: gradient present and above ``ABS_SMALL``, finite weights, lr > 0, no
  GradScaler skip inside the change, and weights that moved (``unchanged_frac`` below
  ``stalled_updates``' 0.9: weights that stopped outright are that check's finding). Other optimizers
  (Adagrad, Adafactor, Lion, ...) and runs without the optimizer in meta.json are not judged.
- ``flat_loss`` (warning): at least ``FLAT_MIN_STEPS`` finite losses at lr > 0, and the median of
  the last ``FLAT_WINDOW`` within ``FLAT_REL`` of the median of the first, and within ``FLAT_Z``
  standard errors of it (the noise measured on the losses' step-to-step changes): the loss did
  not move from its start.

Real output (``tests/analyzer/report/learning_runs.py``: an MLP classifier trained with an AdamW
subclass whose step uses 1e-5 x the lr its param group, hence the trace, shows; trimmed)::

    flat_loss @ step 0: the loss has not moved from its start in 300 steps at lr > 0 (steps 0..299): the
    median of the last 50 losses is 1.391 against 1.391 for the first 50 (+0.02% when noise alone moves
    it ~0.0034); a run that learns lowers it. Check that the optimizer steps ...
    tiny_updates @ step 1: 6 parameter(s) moved orders of magnitude less than ScaledAdamW's rule gives for
    their recorded gradients and lr (about lr per element (Adam's m/(sqrt(v)+eps) is of order 1), less
    where eps dominates): 0.weight (median update 1.6e-08 per element vs ~0.003 expected: 5.3e-06x, over
    299 rows); 0.bias (...) ...; the run hardly trains: look for an lr scaled down where the trace cannot
    see it (a custom optimizer, scheduler or param group, a gradient divided before the step), or updates
    lost to low-precision weights
"""
from __future__ import annotations

import math

import numpy as np
import polars as pl

from ...findings import Finding
from .frames import Frames
from .gradients import ABS_SMALL
from .updates import UNCHANGED, _group_of, _layer_every, _num, _optimizer, _skip_affected

__all__ = ["tiny_updates", "flat_loss", "RATIO", "MIN_ROWS", "FLAT_MIN_STEPS", "FLAT_WINDOW", "FLAT_REL", "FLAT_Z",
           "rule_of"]

RATIO = 1e-3         # measured / expected below this: "orders of magnitude below" the optimizer's rule
MIN_ROWS = 10        # recorded rows (or bins) a parameter needs to be judged
FLAT_MIN_STEPS = 100  # finite losses at lr > 0 needed before a loss can be called flat
FLAT_WINDOW = 50     # steps at the start and at the end whose medians are compared
FLAT_REL = 0.02      # within 2% of the start ...
FLAT_Z = 3.0         # ... and within 3 standard errors of it

def rule_of(cls: str | None) -> str | None:
    """"sgd", "adam" (Adam, AdamW, NAdam, RAdam, Adamax, FusedAdam, AdamW8bit, a subclass named after
    them) or None: an optimizer whose rule this check does not model (Adagrad, Adafactor, Lion, ...)."""
    low = (cls or "").lower()
    if "adam" in low:
        return "adam"
    if "sgd" in low:
        return "sgd"
    return None


def _lr_per_bin(frames: Frames, lb: pl.DataFrame) -> np.ndarray:
    """The mean recorded lr over each bin row's steps (NaN where none is known)."""
    s0 = int(frames.steps["step"].min())
    width = max(1, frames.bin_width)
    per = (frames.steps.filter(pl.col("lr").is_finite())
           .group_by(bin=((pl.col("step") - s0) // width).cast(pl.Int32)).agg(lr=pl.col("lr").mean()))
    got = lb.select("bin").join(per, on="bin", how="left", maintain_order="left")["lr"]
    return got.fill_null(float("nan")).to_numpy().astype(float)


def tiny_updates(frames: Frames) -> list[Finding]:
    """Parameters whose weights move orders of magnitude less than the optimizer's rule implies."""
    lb = frames.layer_bins
    if lb is None or "urms" not in lb.columns or frames.steps.height == 0 or int(lb["n_upd"].sum()) == 0:
        return []
    cls, groups = _optimizer(frames)
    rule = rule_of(cls)
    if rule is None or not groups:
        return []
    lb = lb.sort("layer", "bin")
    affected = _skip_affected(frames, lb)
    lr_run = _lr_per_bin(frames, lb)
    g0 = _num(groups[0].get("lr"))
    layers = lb["layer"].to_numpy()
    lg, urms, unch = (lb[c].cast(pl.Float64).fill_null(float("nan")).to_numpy() for c in ("lg", "urms", "unch"))
    numel = np.array([float(frames.numels[i]) if 0 <= i < len(frames.numels) and frames.numels[i] else np.nan
                      for i in layers])
    # each layer's lr: the recorded lr (the first group's) scaled by its group's lr against the first group's
    scale, eps = np.ones(lb.height), np.zeros(lb.height)
    for i in np.unique(layers):
        g = _group_of(groups, int(i))
        glr, e = (_num(g.get("lr")), _num(g.get("eps"))) if g else (None, None)
        at = layers == i
        scale[at] = glr / g0 if glr is not None and g0 else (np.nan if g is None else 1.0)
        eps[at] = e or 0.0
    lr = lr_run * scale
    grms = 10.0 ** lg / np.sqrt(numel)
    expected = lr * grms if rule == "sgd" else lr * grms / (grms + eps)
    with np.errstate(invalid="ignore", divide="ignore"):
        ok = (np.isfinite(lg) & (lg > math.log10(ABS_SMALL)) & np.isfinite(urms) & np.isfinite(expected)
              & (expected > 0) & ~affected & (lb["pbad"].to_numpy() == 0) & (np.nan_to_num(unch, nan=1.0) < UNCHANGED))
        ratio = np.where(ok, urms / np.where(ok, expected, 1.0), np.nan)
    rows = []
    for i in np.unique(layers[ok]):
        r = ratio[(layers == i) & ok]
        if r.size < MIN_ROWS:
            continue
        med = float(np.median(r))
        if med >= RATIO:
            continue
        at = np.flatnonzero((layers == i) & ok)
        rows.append({"name": frames.param_name(int(i)), "layer": int(i), "rows": int(r.size),
                     "ratio": med, "update_rms": float(np.median(urms[at])),
                     "expected": float(np.median(expected[at])), "lr": float(np.median(lr[at])),
                     "grad_rms": float(np.median(grms[at])), "first_step": int(lb["step_lo"][int(at[0])])})
    if not rows:
        return []
    how = ("about lr per element (Adam's m/(sqrt(v)+eps) is of order 1), less where eps dominates"
           if rule == "adam" else "lr x the gradient")
    shown = "; ".join(f"{x['name']} (median update {x['update_rms']:.2g} per element vs ~{x['expected']:.2g} "
                      f"expected: {x['ratio']:.2g}x, over {x['rows']} rows)" for x in rows[:6])
    more = f" and {len(rows) - 6} more" if len(rows) > 6 else ""
    every = _layer_every(frames)
    msg = (f"{len(rows)} parameter(s) moved orders of magnitude less than {cls}'s rule gives for their recorded "
           f"gradients and lr ({how}): {shown}{more}; the run hardly trains: look for an lr scaled down where the "
           "trace cannot see it (a custom optimizer, scheduler or param group, a gradient divided before the step), "
           "or updates lost to low-precision weights"
           + (f" (rows every {every} steps: the measured change spans them)" if every > 1 else ""))
    ev = {"params": rows[:20], "n_params": len(rows), "optimizer": cls, "rule": rule,
          "thresholds": {"ratio": RATIO, "min_rows": MIN_ROWS, "unchanged": UNCHANGED}}
    first = min(x["first_step"] for x in rows)
    return [Finding("tiny_updates", "warning", first, msg, ev, rank=frames.rank)]


def flat_loss(frames: Frames) -> list[Finding]:
    """The loss has not moved from its start over many steps at lr > 0."""
    df = frames.steps.filter(pl.col("loss").is_finite() & pl.col("lr").is_finite() & (pl.col("lr") > 0))
    if df.height < FLAT_MIN_STEPS:
        return []
    x = df["loss"].to_numpy().astype(float)
    k = min(FLAT_WINDOW, x.size // 4)
    first, last = float(np.median(x[:k])), float(np.median(x[-k:]))
    noise = float(np.median(np.abs(np.diff(x)))) / 0.954  # per-step sd for Gaussian noise
    stderr = 1.2533 * noise * math.sqrt(2.0 / k)  # of the difference of two medians of k values
    change = last - first
    if not (abs(change) <= FLAT_REL * abs(first) and abs(change) <= FLAT_Z * stderr):
        return []
    s0, s1 = int(df["step"][0]), int(df["step"][-1])
    ev = {"steps": int(df.height), "first_median": first, "last_median": last, "window": k,
          "noise": noise, "relative_change": change / first if first else None,
          "thresholds": {"min_steps": FLAT_MIN_STEPS, "window": FLAT_WINDOW, "rel": FLAT_REL, "z": FLAT_Z}}
    msg = (f"the loss has not moved from its start in {df.height} steps at lr > 0 (steps {s0}..{s1}): the median of "
           f"the last {k} losses is {last:.4g} against {first:.4g} for the first {k} ({change / first:+.2%} when "
           f"noise alone moves it ~{stderr:.2g}); a run that learns lowers it. Check that the optimizer steps the "
           "model's parameters with the lr you think (tiny_updates compares each layer's update with the optimizer's "
           "rule)" if first else f"the loss has not moved from its start in {df.height} steps at lr > 0")
    return [Finding("flat_loss", "warning", s0, msg, ev, rank=frames.rank)]

"""Recorder misuse visible in the run: ``scaled_loss`` and ``autocast_inactive``.

Real output (an FP16 run whose loop called ``rec.end_step(scaler.scale(loss))``)::

    scaled_loss @ step 0: the recorded loss moves with the loss scale: at 14 of 14 scale changes it
    changed by the scale's own factor (step 2: scale 6.554e+04 -> 1.311e+05, loss 7.571e+04 ->
    1.288e+05), so the trace holds loss x scale: end_step was given scaler.scale(loss). Pass the
    unscaled loss (scaler.scale(loss).backward(); rec.end_step(loss)); the loss values in this
    report are scaled
        evidence: changes=14 followed=14 step=2 scale_before=6.554e+04 scale_after=1.311e+05 ...

How to read it: the unscaled loss of a healthy run does not double when the scaler doubles its
scale. A noisy loss can hide that; the recorder's own warning (kept in meta.json since format 7, kind
``scaled_loss``) is then the evidence, and the finding says so::

    scaled_loss @ step 3: during training the recorder warned at step 3 that end_step was given the scaled
    loss (loss x the GradScaler's scale, 95.84 at scale 32): the trace holds loss x scale, so the loss values
    in this report are scaled. Pass the unscaled loss (scaler.scale(loss).backward(); rec.end_step(loss))
 ``autocast_inactive`` repeats what the recorder saw at the first step: ``amp_dtype`` said
FP16/BF16 but no autocast region was active for the model's device, so the run trained in FP32.
"""
from __future__ import annotations

import dataclasses

import polars as pl

from ...findings import Finding
from .frames import Frames
from .recorder_warnings import stored_warnings

__all__ = ["scaled_loss", "autocast_inactive", "autocast_was_inactive"]

MIN_CHANGES = 3  # scale changes needed before calling the loss scaled
FOLLOW_FRAC = 0.8  # of those, the share at which the loss moved by the scale's own factor


def scaled_loss(frames: Frames) -> list[Finding]:
    """The loss changes by the scale's factor at (nearly) every scale change, or the recorder warned that
    end_step was given the scaled loss: it was recorded scaled."""
    warned = stored_warnings(frames, "scaled_loss")
    found = _scaled_by_trace(frames)
    if found:
        if warned:
            return [dataclasses.replace(found[0], evidence={**found[0].evidence, "warned_step": warned[0]["step"]})]
        return found
    if not warned:
        return []
    w = warned[0]
    said = w["message"].partition("(loss x the GradScaler's scale")[2].partition(")")[0]
    at = f" at step {w['step']}" if w["step"] is not None else ""
    msg = (f"during training the recorder warned{at} that end_step was given the scaled loss (loss x the "
           f"GradScaler's scale{said}): the trace holds loss x scale, so the loss values in this report are "
           "scaled. Pass the unscaled loss (scaler.scale(loss).backward(); rec.end_step(loss))")
    ev = {"source": "recorder_warning", "warned_step": w["step"], "rank": w["rank"]}
    return [Finding("scaled_loss", "warning", w["step"], msg, ev,
                    rank=w["rank"] if frames.n_ranks > 1 else None)]


def _scaled_by_trace(frames: Frames) -> list[Finding]:
    """The statistical test: the recorded loss follows the scale's changes."""
    df = frames.steps.select("step", "loss", "scale").filter(
        pl.col("loss").is_finite() & (pl.col("loss") != 0) & pl.col("scale").is_finite() & (pl.col("scale") > 0))
    if df.height < 2:
        return []
    df = df.with_columns(prev_loss=pl.col("loss").shift(1), prev_scale=pl.col("scale").shift(1)).filter(
        (pl.col("scale") != pl.col("prev_scale")) & ((pl.col("loss") > 0) == (pl.col("prev_loss") > 0)))
    if df.height < MIN_CHANGES:
        return []
    factor = (pl.col("scale") / pl.col("prev_scale")).log()
    moved = (pl.col("loss") / pl.col("prev_loss")).log()
    df = df.with_columns(followed=(moved - factor).abs() < 0.5 * factor.abs())
    followed = int(df["followed"].sum())
    if followed < FOLLOW_FRAC * df.height:
        return []
    first = df.filter(pl.col("followed")).row(0, named=True)
    ev = {"changes": df.height, "followed": followed, "step": int(first["step"]),
          "scale_before": float(first["prev_scale"]), "scale_after": float(first["scale"]),
          "loss_before": float(first["prev_loss"]), "loss_after": float(first["loss"])}
    msg = (f"the recorded loss moves with the loss scale: at {followed} of {df.height} scale changes it changed by "
           f"the scale's own factor (step {ev['step']}: scale {ev['scale_before']:.4g} -> {ev['scale_after']:.4g}, "
           f"loss {ev['loss_before']:.4g} -> {ev['loss_after']:.4g}), so the trace holds loss x scale: end_step was "
           "given scaler.scale(loss). Pass the unscaled loss (scaler.scale(loss).backward(); rec.end_step(loss)); "
           "the loss values in this report are scaled")
    step = int(frames.steps["step"][0]) if frames.steps.height else None
    return [Finding("scaled_loss", "warning", step, msg, ev)]


def autocast_was_inactive(meta: dict | None) -> dict | None:
    """meta.json's ``autocast`` observation when it says autocast was off for an FP16/BF16 run, else None."""
    seen = (meta or {}).get("autocast") if isinstance(meta, dict) else None
    if isinstance(seen, dict) and seen.get("enabled") is False and (meta or {}).get("amp_dtype"):
        return seen
    return None


def autocast_inactive(frames: Frames) -> list[Finding]:
    """The recorder saw no autocast during the forward although amp_dtype said FP16/BF16."""
    seen = autocast_was_inactive(frames.meta)
    if seen is None:
        return []
    dev, amp = str(seen.get("device_type")), str(frames.meta.get("amp_dtype"))
    others = [str(d) for d in seen.get("active_on") or [] if isinstance(d, str)]
    where = f" (autocast was active for {', '.join(others)} instead)" if others else ""
    step = seen.get("step") if isinstance(seen.get("step"), int) and not isinstance(seen.get("step"), bool) else None
    msg = (f"autocast was not active during the forward: this run trained in FP32, although the recorder was told "
           f"amp_dtype={amp}; the model is on {dev}{where}. Run the forward under torch.autocast(device_type="
           f"{dev!r}, dtype=torch.{amp}), with device_type taken from the model's device")
    ev = {"device_type": dev, "amp_dtype": amp, "active_on": others, "step": step}
    return [Finding("autocast_inactive", "warning", step, msg, ev)]

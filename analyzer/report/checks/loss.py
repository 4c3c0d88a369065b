"""Loss checks: ``nonfinite_loss``, ``loss_spike`` and ``low_precision_loss``.

Real output (a BF16 run whose batch held one NaN at step 30)::

    nonfinite_loss @ step 30: the loss became nan at step 30 (1 non-finite step(s) of 40): in BF16
    (FP32's range) any NaN is a numerical problem, not a range issue: replay it: analyzer replay
    bf16-nan/snapshots/step00000030-r00000-nonfinite_loss.pt
        evidence: loss=nan nonfinite_steps=1 steps=40 last_finite_loss=1.419 skipped_before=0 ...

How to read it: in FP16, ``skipped_before`` and ``scale_fell_before`` say whether the scaler was
backing off (overflow) or steady (then the NaN has another cause). Replay the named snapshot.
"""
from __future__ import annotations

import numpy as np
import polars as pl
from numpy.lib.stride_tricks import sliding_window_view

from ...findings import Finding
from .frames import Frames
from .scaler import calibration_end

__all__ = ["nonfinite_loss", "loss_spike", "low_precision_loss", "micro_batches", "micro_batches_kept",
           "precision_unknown"]

STABLE_WINDOW = 50   # steps looked at before the first non-finite loss
RECENT = 5           # a skip this close before the failure means the scaler was backing off
SPIKE_WINDOW = 50    # rolling baseline length
SPIKE_Z = 10.0       # robust z-score (MAD units) above the rolling median
SPIKE_REL = 0.25     # and at least 25% above the rolling median
MAX_CANDIDATES = 100_000  # screened steps scored exactly (a pathological loss could have more)
MOVE_DECADES = 0.5   # a layer "moved" when its grad norm left its baseline by > ~3x


def snapshot_for(frames: Frames, step: int, rank: int | None) -> str | None:
    cands = [s for s in frames.snapshots if s.step is not None and s.step >= step
             and (rank is None or s.rank == rank)]
    return min(cands, key=lambda s: (s.step, s.rank or 0)).file if cands else None


def _first_rank(frames: Frames) -> tuple[int | None, int | None]:
    r = frames.ranks.filter(pl.col("first_nonfinite_step").is_not_null()).sort("first_nonfinite_step", "rank")
    return (int(r["rank"][0]), int(r["first_nonfinite_step"][0])) if r.height else (None, None)


def precision_unknown(frames: Frames) -> bool:
    """An imported log that does not say which precision ran (a recorder run always does)."""
    return frames.source_format != "amp-autopsy" and frames.amp_dtype is None


def micro_batches(frames: Frames) -> int:
    """meta.json's micro_batches (format 4): forwards accumulated into one recorded step; 1 if unknown."""
    mb = (frames.meta or {}).get("micro_batches")
    return mb if isinstance(mb, int) and not isinstance(mb, bool) and mb > 1 else 1


def micro_batches_kept(frames: Frames) -> bool:
    """meta.json's micro_batches_kept (format 6): snapshots hold every micro-batch of their step."""
    return (frames.meta or {}).get("micro_batches_kept") is True


def nonfinite_loss(frames: Frames) -> list[Finding]:
    """The first NaN/Inf loss, and whether the scale was stable before it (then: not overflow)."""
    df = frames.steps.filter(pl.col("loss").is_not_null())
    bad = df.filter(~pl.col("loss").is_finite())
    if bad.height == 0:
        return []
    step, loss = int(bad["step"][0]), float(bad["loss"][0])
    rank, _ = _first_rank(frames) if frames.rank is None else (frames.rank, None)
    before_all = df.filter((pl.col("step") < step)).tail(STABLE_WINDOW)
    # GradScaler's start-up calibration is no sign of overflow at the failure: judge the steps after it
    cal = calibration_end(frames)
    cal_last = cal["last_step"] if cal is not None and cal["settled"] and cal["last_step"] < step else None
    before = before_all if cal_last is None else before_all.filter(pl.col("step") > cal_last)
    skipped = before["skipped"].fill_null(False)
    skips = int(skipped.sum()) if before.height else 0
    scales = before["scale"].drop_nulls()
    all_scales = before_all["scale"].drop_nulls()
    # one skip per growth interval is the scaler's normal rhythm (grow, overflow, back off);
    # backing off means two or more net backoffs, or skips right before the failure
    fell = bool(scales.len() > 1 and scales[-1] <= scales.max() / 4)
    stable = not fell and int(skipped.tail(RECENT).sum()) == 0 and skips <= 2
    snap = snapshot_for(frames, step, rank)
    replay = (f"replay it: analyzer replay {snap}" if snap else
              "record the run with the Recorder to get a snapshot of this step, then run analyzer replay")
    ev = {"loss": loss, "nonfinite_steps": bad.height, "steps": df.height,
          "last_finite_loss": float(before_all["loss"][-1]) if before_all.height else None,
          "skipped_before": skips, "window": before.height, "scale_fell_before": fell,
          "scale_before": float(all_scales[-1]) if all_scales.len() else None, "amp_dtype": frames.amp_dtype,
          "snapshot": snap, "rank": rank, "calibration_last_step": cal_last}
    where = f" on rank {rank}" if rank is not None and frames.n_ranks > 1 else ""
    head = f"the loss became {loss} at step {step}{where} ({bad.height} non-finite step(s) of {df.height})"
    after_cal = "" if cal_last is None else f" since GradScaler's start-up calibration ended at step {cal_last}"
    if before_all.height == 0:
        body = ("it is the first step with a recorded loss, so nothing before it says how the run got there: the "
                "model or the loss is broken from the start (a bad init, an FP16 overflow on the first "
                f"batch, a log(0) or division by zero in the loss, a NaN in the batch); {replay} to tell which")
    elif frames.amp_dtype == "float16" and all_scales.len() == 0:
        body = ("no GradScaler scale was recorded, so FP16 gradients ran unscaled: either a forward "
                "activation passed FP16's 65504 or a numerical fault (log(0), division by zero, a NaN in "
                f"the batch); {replay} to tell which, and train FP16 with a GradScaler")
    elif frames.amp_dtype == "float16" and not stable:
        body = (f"the scaler was backing off before it ({skips} skipped step(s) in the previous "
                f"{before.height}{after_cal}, scale {'falling' if fell else 'unsteady'}): FP16 overflow; see "
                f"scale_collapse / frequent_overflow, and {replay}")
    elif frames.amp_dtype == "float16":
        body = (f"the scale was stable ({ev['scale_before']:g}, {skips} skipped step(s) in the previous "
                f"{before.height}{after_cal}, the scaler's normal rhythm), so this is not a gradient overflow that "
                "loss scaling absorbs: either a forward activation passed FP16's 65504 or a numerical "
                f"fault (log(0), division by zero, a NaN in the batch); {replay} to tell which")
    elif frames.amp_dtype == "bfloat16":
        body = f"in BF16 (FP32's range) any NaN is a numerical problem, not a range issue: {replay}"
    elif precision_unknown(frames):
        body = ("the log does not say which precision ran, so an FP16 overflow and a numerical fault (log(0), "
                f"division by zero, a NaN in the batch) are both possible: {replay}")
    else:
        body = f"a numerical fault, not a precision range issue: {replay}"
    micro = micro_batches(frames)
    if micro > 1:
        ev["micro_batches"] = micro
        if micro_batches_kept(frames):
            body += (f"; the step accumulates {micro} micro-batches and its snapshot holds them all: a replay "
                     "re-runs each and names the one that failed")
        else:
            body += (f"; NB: the step accumulates {micro} micro-batches and its snapshot holds the first only, "
                     "so a replay re-runs that one alone and may not reproduce the failure")
    return [Finding("nonfinite_loss", "error", step, f"{head}: {body}", ev, rank=rank)]


def _moved_first(frames: Frames, step: int) -> dict | None:
    """Which layer's grad norm left its baseline first in the few steps up to `step`."""
    if frames.layer_window is None:
        return None
    win = frames.layer_window(step - SPIKE_WINDOW, step)
    if win.height == 0:
        return None
    pre = win.filter(pl.col("step") < step - 5)
    base = pre.group_by("layer").agg(med=pl.col("lg").median(),
                                     mad=(pl.col("lg") - pl.col("lg").median()).abs().median())
    near = win.filter(pl.col("step") >= step - 5).join(base, on="layer")
    near = near.with_columns(dev=(pl.col("lg") - pl.col("med")).abs())
    moved = near.filter(pl.col("dev") > pl.max_horizontal(6 * 1.4826 * pl.col("mad"), pl.lit(MOVE_DECADES)))
    if moved.height == 0:
        return {"layer": None, "note": "no layer's gradient norm moved before the spike"}
    first = moved.sort("step", pl.col("dev"), descending=[False, True]).row(0, named=True)
    return {"layer": frames.param_name(int(first["layer"])), "layer_index": int(first["layer"]),
            "step": int(first["step"]), "grad_norm_ratio": float(10 ** (first["lg"] - first["med"]))}


def loss_spike(frames: Frames) -> list[Finding]:
    """Upward spikes above a rolling median + MAD baseline; names the layer that moved first."""
    df = frames.steps.filter(pl.col("loss").is_finite()).select("step", "loss")
    if df.height <= SPIKE_WINDOW:
        return []
    # cheap screen with polars' rolling median, then the exact median and MAD of the previous
    # SPIKE_WINDOW finite losses for the few candidates only (1M steps: 0.2 s instead of 1.4 s)
    loss, med = pl.col("loss"), pl.col("med")
    cand = (df.with_row_index("i").with_columns(med=loss.rolling_median(SPIKE_WINDOW).shift(1))  # computed once
            .filter(loss - med > SPIKE_REL * med.abs())["i"].to_numpy())
    cand = cand[cand >= SPIKE_WINDOW][:MAX_CANDIDATES]
    if cand.size == 0:
        return []
    x = df["loss"].to_numpy()
    win = sliding_window_view(x, SPIKE_WINDOW)[cand - SPIKE_WINDOW]  # the window before each candidate
    base = np.median(win, axis=1)
    mad = np.median(np.abs(win - base[:, None]), axis=1)
    z = (x[cand] - base) / (1.4826 * mad + 1e-12)
    hit = (z > SPIKE_Z) & (x[cand] - base > SPIKE_REL * np.abs(base))
    idx, base, z = cand[hit], base[hit], z[hit]
    first = np.ones(idx.size, bool)
    first[1:] = np.diff(idx) > 1  # first step of each run of consecutive spiking steps
    spikes = pl.DataFrame({"step": df["step"].to_numpy()[idx[first]], "loss": x[idx[first]],
                           "med": base[first], "z": z[first]})
    if spikes.height == 0:
        return []
    top = spikes.head(5)
    s0 = top.row(0, named=True)
    moved = _moved_first(frames, int(s0["step"]))
    ev = {"spikes": spikes.height,
          "first": [{"step": int(r["step"]), "loss": float(r["loss"]), "baseline": float(r["med"]),
                     "z": float(r["z"])} for r in top.iter_rows(named=True)],
          "moved_first": moved}
    who = ""
    if moved and moved.get("layer"):
        who = (f"; {moved['layer']}'s gradient norm moved first (x{moved['grad_norm_ratio']:.3g} "
               f"at step {moved['step']})")
    return [Finding("loss_spike", "warning", int(s0["step"]),
                    f"{spikes.height} loss spike(s); the first at step {s0['step']}: {s0['loss']:.4g} against "
                    f"a rolling median of {s0['med']:.4g} ({s0['z']:.0f} MADs){who}", ev)]


def low_precision_loss(frames: Frames) -> list[Finding]:
    """The loss tensor was FP16/BF16: it was computed outside autocast."""
    df = frames.steps.filter(pl.col("loss_dtype").is_in(["float16", "bfloat16"]))
    if df.height == 0:
        return []
    dtype = df["loss_dtype"][0]
    total = frames.steps.filter(pl.col("loss_dtype").is_not_null()).height
    ev = {"loss_dtype": dtype, "steps": df.height, "of": total, "first_step": int(df["step"][0])}
    limit = "overflows above 65504 and" if dtype == "float16" else ""
    return [Finding("low_precision_loss", "warning", int(df["step"][0]),
                    f"the loss was {dtype} on {df.height} of {total} steps: it was computed outside autocast "
                    f"(inside, cross_entropy/mse_loss return float32); a {dtype} loss {limit} rounds to "
                    f"{'3' if dtype == 'float16' else '2'} significant digits. Move the loss computation "
                    "inside the autocast block", ev)]


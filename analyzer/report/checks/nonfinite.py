"""Gradient check: ``nonfinite_grads``, gradients that went NaN/Inf while the loss stayed finite.

With a GradScaler, a finite loss with non-finite gradients is a skipped step: the scaler
absorbs it (``frequent_overflow`` and ``scale_collapse`` judge how often). Without one (BF16,
FP32, FP16 without a scaler), or when the scaler did not skip the step, the optimizer steps on
NaN/Inf and poisons the weights: the loss goes non-finite one step later, and a report that only
named that later ``nonfinite_loss`` would point at the wrong step.

Real output (``tests/analyzer/report/report_models.build_sqrt_norm``, BF16, a batch whose first row
is all zeros at step 12: ``sqrt`` of a zero sum of squares has an infinite derivative)::

    Verdict: FAILED: the gradients of 1 parameter(s) went non-finite at step 12 while the loss
    stayed finite at 1.383 (nonfinite_grads, step 12); 2 error(s), 0 warning(s)

    errors
      nonfinite_grads @ step 12: the gradients of 1 parameter(s) went non-finite at step 12 while
      the loss stayed finite at 1.383 (proj.weight): in BF16 (FP32's range) any NaN/Inf is a real
      numerical bug in backward or in the loss (sqrt or norm at 0, division by zero, log(0), a
      custom backward), not a range issue; the loss went non-finite at step 13; replay it:
      analyzer replay run/snapshots/step00000012-r00000-nonfinite_grads.pt
          evidence: step=12 params=[proj.weight] n_params=1 nearest_output=proj.weight loss=1.383
          loss_finite=True first_nonfinite_loss_step=13 nonfinite_elements=256 ...
      nonfinite_loss @ step 13: the loss became nan at step 13 (7 non-finite step(s) of 20): ...

How to read it: ``params`` lists the parameters whose gradients were non-finite at that step,
in model order; backward runs from the output to the input, so ``nearest_output`` is the one
closest to where backward first produced the NaN. Replay the snapshot to name the op.
"""
from __future__ import annotations

import polars as pl

from ...findings import Finding
from .frames import Frames
from .loss import micro_batches, micro_batches_kept, precision_unknown, snapshot_for

__all__ = ["nonfinite_grads"]

_SHOWN = 6


def _first_bad_step(frames: Frames) -> dict | None:
    s = frames.steps
    loss = pl.col("loss")
    # no scaler, or a scaler that did not skip; a null `skipped` beside a scale is unknown: not flagged
    unabsorbed = pl.col("scale").is_null() | ~pl.col("skipped")
    # an imported log has no element count: a NaN/Inf logged grad_norm (HF's log_history) says as much
    gn = pl.col("grad_norm")
    counted = pl.col("nonfinite_grads").fill_null(0) > 0
    logged = pl.col("nonfinite_grads").is_null() & gn.is_not_null() & ~gn.is_finite()
    hit = s.filter((counted | logged) & (loss.is_finite() | loss.is_null()) & unabsorbed.fill_null(False))
    return hit.row(0, named=True) if hit.height else None


def _bad_params(frames: Frames, step: int) -> tuple[list[str], bool]:
    """Names of the parameters whose gradient was non-finite at `step` (model order), and whether
    the layer trace has a row for that step at all."""
    if frames.layer_rows is None:
        return [], False
    rows = frames.layer_rows(step, step)  # already narrowed to frames.rank, like every frame
    if rows.height == 0:
        return [], False
    gn = pl.col("grad_norm")
    bad = rows.filter((pl.col("grad_nonfinite").fill_null(0) > 0) | (gn.is_not_null() & ~gn.is_finite()))
    layers = sorted({int(i) for i in bad["layer"].to_list()})
    return [frames.param_name(i) for i in layers], True


def _peers_gone_bad(frames: Frames, step: int) -> dict[int, int]:
    """With --rank R: the other ranks whose loss went non-finite at or before `step`."""
    if frames.rank is None or frames.n_ranks < 2:
        return {}
    r = frames.ranks.filter((pl.col("rank") != frames.rank) & (pl.col("first_nonfinite_step") <= step))
    return {int(k): int(v) for k, v in zip(r["rank"].to_list(), r["first_nonfinite_step"].to_list())}


def nonfinite_grads(frames: Frames) -> list[Finding]:
    """The first step whose gradients hold NaN/Inf while the loss is finite and no scaler skips it."""
    row = _first_bad_step(frames)
    if row is None:
        return []
    step = int(row["step"])
    names, have_rows = _bad_params(frames, step)
    later = frames.steps.filter((pl.col("step") > step) & pl.col("loss").is_not_null()
                                & ~pl.col("loss").is_finite())
    loss_bad_at = int(later["step"][0]) if later.height else None
    scaler = row["scale"] is not None
    rank = frames.rank
    snap = snapshot_for(frames, step, rank)
    replay = (f"replay it: analyzer replay {snap}" if snap else
              "record the run with the Recorder to get a snapshot of this step, then run analyzer replay")
    loss = row["loss"]
    filtered = bool(row.get("loss_filtered"))  # HF's logging_nan_inf_filter may have replaced it
    micro = micro_batches(frames)
    ev = {"step": step, "params": names[:20], "n_params": len(names),
          "nearest_output": names[-1] if names else None, "loss": loss, "loss_finite": loss is not None,
          "first_nonfinite_loss_step": loss_bad_at, "nonfinite_elements": row["nonfinite_grads"],
          "amp_dtype": frames.amp_dtype, "scaler": scaler, "skipped": row["skipped"],
          "snapshot": snap, "rank": rank, "grad_norm": row["grad_norm"]}
    if filtered:
        ev["loss_filtered"] = True
    if micro > 1:
        ev["micro_batches"] = micro
    shown = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
    if names:
        who = f"the gradients of {len(names)} parameter(s)"
    elif frames.layer_rows is None and row["nonfinite_grads"] is None:  # an imported log: its grad_norm
        who = "the logged gradient norm"
    else:
        who = "gradients" + ("" if have_rows else " (the per-layer trace has no row for this step)")
    if filtered:
        stayed = ("the real loss is unknown, since HF's logging_nan_inf_filter (on by default) logs a NaN/Inf "
                  "loss as the running mean")
    else:
        stayed = f"the loss stayed finite at {loss:.4g}" if loss is not None else "the loss was not recorded"
    head = f"{who} went non-finite at step {step} while {stayed}" + (f" ({shown})" if names else "")
    if frames.amp_dtype == "float16" and not scaler:
        why = ("this FP16 run has no GradScaler, and an unscaled FP16 backward can overflow (a gradient "
               "past 65504) or underflow: train FP16 with torch.amp.GradScaler, which skips such steps "
               "and adjusts the scale")
    elif scaler:
        why = ("a GradScaler was active but did not skip this step, so the optimizer stepped on them: "
               "call scaler.step(optimizer) (not optimizer.step()) and scaler.update() every step")
    elif micro > 1 and micro_batches_kept(frames):
        why = (f"the step's gradients sum {micro} accumulated micro-batches, any of which may hold the NaN/Inf "
               "(in a batch, in the forward, in backward or the loss); its snapshot holds them all, and a replay "
               "re-runs each and names the micro-batch and the op")
    elif micro > 1:
        why = (f"the step's gradients sum {micro} accumulated micro-batches and the recorder saw the first one's "
               "batch only, so the NaN/Inf may come from any of them, in the forward (a NaN in a batch, an "
               "overflow) as well as in backward or the loss; replaying the first micro-batch may not reproduce it")
    elif precision_unknown(frames):
        why = ("the log does not say which precision ran: in FP16 without a GradScaler a gradient past 65504 "
               "overflows; in BF16 or FP32 it is a numerical fault (sqrt or norm at 0, division by zero, log(0), "
               "a NaN in the batch)")
    else:
        rng = "in BF16 (FP32's range)" if frames.amp_dtype == "bfloat16" else "in FP32"
        why = (f"{rng} any NaN/Inf is a real numerical bug in backward or in the loss (sqrt or norm at 0, "
               "division by zero, log(0), a custom backward), not a range issue")
    after = f"; the loss went non-finite at step {loss_bad_at}" if loss_bad_at is not None else ""
    peers = _peers_gone_bad(frames, step)
    if peers:
        ev["peer_nonfinite_loss"] = peers
        r, at = min(peers.items(), key=lambda kv: (kv[1], kv[0]))
        why = (f"rank {r}'s loss went non-finite at step {at}: under DDP its gradients are averaged into "
               f"this rank's, so the cause is rank {r}'s step (see rank_divergence; replay rank {r}'s snapshot)")
    return [Finding("nonfinite_grads", "error", step, f"{head}: {why}{after}; {replay}", ev, rank=rank)]

"""The ``exception`` check: the training loop raised, and where (meta.json's ``exception``, format 4).

A run that dies by an exception (``clip_grad_norm_(..., error_if_nonfinite=True)``, an
``assert torch.isfinite(loss)``, an out-of-memory error) leaves no NaN loss behind: the recorder
keeps the exception in meta.json and, when it came inside a step, a trace row and an ``exception``
snapshot of that step. The finding is an error at that step, with the message, the user's frame,
and which of the loss and the gradients was non-finite first.

Real output (``tests/exception_runs.py``: FP16, GradScaler at 256, a batch that overflows FP16)::

    exception @ step 5: the loop raised RuntimeError at step 5: The total norm of order 2.0 for
    gradients from `parameters` is non-finite, so it cannot be clipped. ... (at
    tests/exception_runs.py:58 in clip_loop: torch.nn.utils.clip_grad_norm_(...)); the gradients were
    non-finite at that step (16 element(s)); its loss was not recorded (the step raised before
    end_step); GradScaler would have skipped this step ...; replay it: analyzer replay
    run/snapshots/step00000005-r00000-exception.pt

How to read it: the step is the one that raised; the frame is the innermost line of the user's own
code. "which came first" compares the first non-finite loss and gradients of the trace up to that
step. A ``KeyboardInterrupt`` or ``SystemExit`` is reported as an ``info`` interruption, not a failure.
"""
from __future__ import annotations

import math
from pathlib import Path

import polars as pl

from recorders import schema

from ...findings import Finding
from ...load.exceptions import raised_text, read_exception
from .frames import Frames

__all__ = ["exception"]

_CLIP = "is non-finite, so it cannot be clipped"  # torch.nn.utils.clip_grad_norm_(error_if_nonfinite=True)


def _snapshot(frames: Frames, step: int | None, rank: int | None) -> str | None:
    for s in frames.snapshots:
        if s.reason == schema.REASON_EXCEPTION and s.step == step and (rank is None or s.rank == rank):
            return s.file
    return None


def _row(frames: Frames, step: int) -> dict | None:
    hit = frames.steps.filter(pl.col("step") == step)
    return hit.row(0, named=True) if hit.height else None


def _bad(v) -> bool:
    return isinstance(v, float) and not math.isfinite(v)


def _first(frames: Frames, step: int) -> tuple[int | None, int | None]:
    """The first step <= `step` with a non-finite loss, and with non-finite gradients."""
    s = frames.steps.filter(pl.col("step") <= step)
    loss, gn = pl.col("loss"), pl.col("grad_norm")
    bad_loss = s.filter(loss.is_not_null() & ~loss.is_finite())
    bad_grads = s.filter((pl.col("nonfinite_grads").fill_null(0) > 0) | (gn.is_not_null() & ~gn.is_finite()))
    return (int(bad_loss["step"][0]) if bad_loss.height else None,
            int(bad_grads["step"][0]) if bad_grads.height else None)


def _which_first(frames: Frames, step: int, row: dict | None) -> tuple[str, dict]:
    """A clause saying what was non-finite at `step`, and which came first; and its evidence."""
    if row is None:
        return "the trace has no row for that step", {}
    loss, n_bad, gnorm = row.get("loss"), row.get("nonfinite_grads"), row.get("grad_norm")
    grads_bad = bool(n_bad) or _bad(gnorm)
    loss_bad = _bad(loss)
    first_loss, first_grads = _first(frames, step)
    ev = {"loss": loss, "grad_norm": gnorm, "nonfinite_grads": n_bad, "loss_nonfinite": loss_bad,
          "grads_nonfinite": grads_bad, "first_nonfinite_loss_step": first_loss,
          "first_nonfinite_grads_step": first_grads}
    if gnorm is None and n_bad is None:
        what = "no gradients existed yet (it raised before backward)"
    elif grads_bad:
        what = f"the gradients were non-finite at that step ({n_bad} element(s))" if n_bad else \
            "the gradients' norm was non-finite at that step"
    else:
        what = "the gradients were finite at that step"
    if loss is None:
        what += "; its loss was not recorded (the step raised before end_step)"
    elif loss_bad:
        what += f"; its loss was {loss}"
    if first_loss is None and first_grads is None:
        order = ""
    elif first_loss is None or first_grads is None:
        name, at = ("loss", first_loss) if first_grads is None else ("gradients", first_grads)
        order = f"; the first non-finite values the trace holds are the {name} at step {at}"
    elif first_loss == first_grads:
        order = f"; the loss and the gradients both went non-finite first at step {first_loss}: the loss (forward) " \
                "comes before the gradients (backward)"
    else:
        a, b = ("loss", "gradients") if first_loss < first_grads else ("gradients", "loss")
        order = f"; the {a} went non-finite first (step {min(first_loss, first_grads)}), the {b} at step " \
                f"{max(first_loss, first_grads)}"
    return what + order, ev


def _finding(frames: Frames, entry: dict, rank: int | None) -> Finding:
    step, kind = entry["step"], entry["type"]
    message = " ".join(entry["message"].split())
    raised = raised_text(entry, limit=1000)
    ev = {"type": kind, "message": entry["message"], "frames": entry["frames"], "step": step,
          "last_step": entry["last_step"], "rank": rank}
    if not entry["failure"]:
        where = f"in step {step}" if step is not None else "outside any step"
        return Finding("exception", "info", step, f"the run was interrupted {where}: {raised}", ev, rank=rank)
    if step is None:
        after = (f"after step {entry['last_step']} had ended (in the optimizer step, the scheduler or the data "
                 "loader)" if entry["last_step"] is not None else "before the first step")
        text = (f"the loop raised {after}: {raised}; no step was open, so there is no snapshot to "
                "replay: its last recorded steps are in the trace")
        return Finding("exception", "error", entry["last_step"], text, ev, rank=rank)
    clause, more = _which_first(frames, step, _row(frames, step))
    ev.update(more)
    snap = _snapshot(frames, step, rank)
    ev["snapshot"] = snap
    hint = ""
    if _CLIP in message and more.get("grads_nonfinite"):
        scaled = (_row(frames, step) or {}).get("scale") is not None
        hint = ("; a GradScaler skips exactly such a step (and lowers the scale): with "
                "error_if_nonfinite=True the clip raises on it first" if scaled else
                "; error_if_nonfinite=True raises on any non-finite gradient norm: without a GradScaler "
                "nothing else would have stopped this step")
    replay = f"; replay it: analyzer autopsy, or analyzer replay {snap}" if snap else \
        "; the recorder wrote no snapshot of it (see its warning)"
    return Finding("exception", "error", step, f"the loop raised at step {step}: {raised}; "
                                               f"{clause}{hint}{replay}", ev, rank=rank)


def exception(frames: Frames) -> list[Finding]:
    """One finding per exception the run raised: meta.json's entry (rank 0), and the ``exception``
    snapshots of the other ranks (named by their files only: a report opens no snapshot)."""
    out: list[Finding] = []
    seen: set = set()
    if frames.rank in (None, 0):
        try:
            entry = read_exception((frames.meta or {}).get("exception"))
        except ValueError:
            entry = None  # a damaged entry: the snapshots below still say where the run raised
        if entry is not None:
            out.append(_finding(frames, entry, 0 if frames.n_ranks > 1 or frames.rank == 0 else None))
            seen.add((0, entry["step"]))
    for s in frames.snapshots:
        if s.reason != schema.REASON_EXCEPTION or s.step is None or (s.rank, s.step) in seen:
            continue
        seen.add((s.rank, s.step))
        step = s.step
        clause, ev = _which_first(frames, step, _row(frames, step))
        out.append(Finding("exception", "error", step,
                           f"rank {s.rank}'s loop raised at step {step}; {clause}; replay it: analyzer replay "
                           f"{s.file}", {**ev, "snapshot": s.file, "step": step, "rank": s.rank,
                                         "file": Path(s.file).name}, rank=s.rank))
    return out

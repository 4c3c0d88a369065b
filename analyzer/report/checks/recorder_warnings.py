"""The RecorderWarnings kept in meta.json (format 7), repeated by the report: ``recorder_warning``.

The recorder issues a ``RecorderWarning`` when it notices a misuse (a scaled loss given to
``end_step``, ``begin_step`` without ``end_step``, autocast off) or cannot record something (a full
disk, an internal error). A training log scrolls past it; meta.json keeps it, by kind
(``recorders.schema.WARNING_KINDS``) and step, and every report shows it again.

Real output (an FP16 loop that passed ``check_update=True`` with an optimizer-like object)::

    recorder_warning @ step 0: during training the recorder warned (no_step_hook): amp-autopsy
    recorder: check_update=True needs a torch.optim.Optimizer (its register_step_post_hook);
    _Opt has none, so optimizer steps are not checked
        evidence: kind=no_step_hook step=0 rank=0

Kinds a check of their own reports (``scaled_loss``, ``autocast_inactive``) are left to that check.
"""
from __future__ import annotations

from typing import Any

from recorders import schema

from ...findings import Finding
from .frames import Frames

__all__ = ["recorder_warning", "stored_warnings", "OWN_CHECK"]

# warning kinds whose finding comes from a check of the same name (checks/mistakes.py)
OWN_CHECK = ("scaled_loss", "autocast_inactive")
_SEVERITY = {"write_error": "warning", "stopped": "warning", "shared_rank": "warning",
             "end_step_missing": "warning", "autocast_dtype": "warning", "exception_not_recorded": "warning",
             # the HF Trainer callback's: a step, a batch entry or the pre-clip norms missing; FP16 asked, FP32 run
             "step_not_recorded": "warning", "positional_inputs": "warning", "grads_post_clip": "warning",
             "fp16_cpu_as_fp32": "warning"}


def stored_warnings(frames: Frames, kind: str | None = None) -> list[dict[str, Any]]:
    """Every well-formed entry of the ranks' meta.json ``warnings`` (of `kind`, if given), in rank order,
    each ``{"kind", "step", "message", "rank"}``. Entries that are not a kind and a message are skipped:
    a damaged or foreign entry is no warning. At most ``schema.MAX_WARNINGS`` per rank."""
    metas = frames.metas or ({0: frames.meta} if frames.meta else {})
    out = []
    for rank in sorted(metas):
        if frames.rank is not None and rank != frames.rank:
            continue
        entries = (metas[rank] or {}).get("warnings")
        if not isinstance(entries, list):  # runs before format 7: nothing kept
            continue
        for e in entries[:schema.MAX_WARNINGS]:
            if not (isinstance(e, dict) and isinstance(e.get("kind"), str) and isinstance(e.get("message"), str)):
                continue
            if kind is not None and e["kind"] != kind:
                continue
            step = e.get("step")
            out.append({"kind": e["kind"][:64], "message": e["message"][:schema.MAX_WARNING_CHARS],
                        "step": step if isinstance(step, int) and not isinstance(step, bool) else None,
                        "rank": rank})
    return out


def recorder_warning(frames: Frames) -> list[Finding]:
    """One finding per RecorderWarning kept in meta.json, except kinds reported by their own check."""
    out = []
    for w in stored_warnings(frames):
        if w["kind"] in OWN_CHECK:
            continue
        known = w["kind"] in schema.WARNING_KINDS
        what = w["kind"] if known else f"{w['kind']}, a kind this analyzer does not know"
        out.append(Finding("recorder_warning", _SEVERITY.get(w["kind"], "info"), w["step"],
                           f"during training the recorder warned ({what}): {w['message']}",
                           {"kind": w["kind"], "step": w["step"], "rank": w["rank"]},
                           rank=w["rank"] if frames.n_ranks > 1 else None))
    return out

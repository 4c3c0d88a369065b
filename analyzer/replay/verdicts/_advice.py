"""Advice with a status: the verdict's advice lines merged with the fixes tried on the snapshot."""
from __future__ import annotations

from ..detection._patterns import patterns
from ..fixes.registry import FIXES, Advice, Fix
from ..result.replay_result import ReplayResult
from .registry import respect_runs

__all__ = ["advice_with_status"]

_NOT_RECOMMENDED = ("fails", "changes_result")  # still non-finite, or finite and far from FP32


def _against(f: Fix) -> str:
    """The fixed step's loss beside the one it was judged against."""
    if f.loss is None:
        return ""
    ref = "no reference" if f.reference_loss is None else f"reference {f.reference_loss:.4g}"
    return f" (fixed step's loss {f.loss:.4g}, {ref})"


def advice_with_status(result: ReplayResult, fixes: list[Fix]) -> list[Advice]:
    """The verdict's advice with each line's status; lines resting on a failed fix are dropped.

    Verified fixes come first (each as the line its ``FixSpec.line`` writes), then the
    hand-written patterns recognised around the culprit (``log(1 - sigmoid(x))`` ->
    ``binary_cross_entropy_with_logits``...), then the rest, untested. A line is tied to the
    fixes it recommends by their names (``AdviceLine.fixes``): a line whose fix was verified is
    replaced by that fix's own line, one resting only on fixes that failed or changed the step's
    result (``changes_result``) is dropped.
    """
    by_name = {f.name: f for f in fixes}
    c = result.culprit
    out = [Advice(FIXES[f.name].line(f, c, result.precision_mode) + _against(f), "verified", f.name)
           for f in fixes if f.status == "verified" and c is not None]
    out += [Advice(text, "untested") for text in patterns(result)]
    tried = {p: bool(r.get("finite")) for p, r in (result.runs or {}).items()}
    for line in respect_runs(list(result.advice_lines), tried):
        mine = [by_name[n] for n in line.fixes if n in by_name]
        if any(f.status == "verified" for f in mine):
            continue  # its fix's own line is already first
        if mine and all(f.status in _NOT_RECOMMENDED for f in mine):
            continue
        out.append(Advice(line.text, "checked" if line.checked else "untested", mine[0].name if mine else None))
    return out

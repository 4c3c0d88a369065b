"""The autopsy's answer: a few plain lines, root cause first, then where, then what was proven to fix it.

The lines are a value of the analysis (they are the ``answer`` field of ``autopsy --json``), so
they are built here, once, and the text renderer only prints them. The rule: a fix
whose counterfactual replay still went non-finite is never worded as a recommendation; it is
listed as ``tried, fails:``. Advice nobody could try (``use binary_cross_entropy_with_logits``)
is printed, marked ``untested``.

Real output (the demo run, ``analyzer autopsy amp-autopsy-demo/fp16_attention_overflow``; long
lines cut here)::

    root cause: overflow: aten.bmm in `blocks.0.attn` (forward, float16) at samples/models.py:98
      produced inf from finite inputs: recomputed in FP32 from the same inputs its largest value is ...
      Why so large: the culprit's inputs were multiplied by 316 (aten.mul at samples/models.py:97, ops
      #32 and #33), the aten.rsqrt of `blocks.0.attn.temperature` = 1e-05 (samples/models.py:96, op #31) ...
    where: aten.bmm in blocks.0.attn at samples/models.py:98, forward, float16, step 24, rank 0
      (step00000024-r00000-nonfinite_loss.pt)
    verified fix: keep blocks.0.attn and the 1 other module of its class (blocks.1.attn) in FP32 ...
    verified fix: switch from FP16 to BF16: step 24 runs finite in bfloat16: loss and every gradient; ...
    tried, fails: run aten.bmm in blocks.0.attn (forward) alone in FP32, its result cast back to
      float16: still non-finite at loss scale 4096: the loss, first at aten.bmm in blocks.0.attn (forward)
    do (verified above): Switch to BF16 (torch.autocast(..., dtype=torch.bfloat16)); BF16 needs no GradScaler.
    checked: Dividing the attention logits by sqrt(head_dim) = 4 is not enough here: the largest
      logit, 3.39e+05 in FP32, would still be 8.49e+04, past float16's max 65504.
    also step 31, rank 0 (overflow_streak): overflow at aten.bmm in blocks.0.attn (forward); same culprit
      as step00000024-r00000-nonfinite_loss.pt, whose fixes apply

How to read it: the first line is the verdict and why; ``where`` is the op, its module, source
line, phase, precision, step and rank; ``verified fix`` lines were re-run on the failing step and
came out as FP32 computes it (every gradient finite, the loss within tolerance of the FP32 run's,
both shown); ``tried, changes the result`` lines came out finite but far from FP32 (a clamp that
hides a negative variance), never recommended; ``tried, fails`` lines were re-run and were not finite;
``untested advice`` could not be tried on a snapshot; ``checked`` lines state what the replay's values show (why a remedy is not offered); ``also`` lines are the other snapshots picked.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..load.exceptions import raised_text
from recorders import schema

if TYPE_CHECKING:
    from ..load import SnapshotInfo
    from .result import AutopsyResult

__all__ = ["answer_lines"]

_FIX_LABEL = {"verified": "verified fix", "changes_result": "tried, changes the result", "fails": "tried, fails",
              "not_tried": "not tried"}


def _where(result: Any, info: SnapshotInfo | None) -> str:
    c = result.culprit
    rank = info.rank if info else None
    bits = [f"{c['op']} in {c['module'] or '(no module)'}" + (f" at {c['source']}" if c["source"] else ""),
            c["phase"], c["precision"]] + ([f"step {result.step}"] if result.step is not None else [])
    if rank is not None:
        bits.append(f"rank {rank}")
    return "where: " + ", ".join(str(b) for b in bits) + f" ({Path(result.snapshot).name})"


def _first_nonfinite(result: Any) -> list[str]:
    """The forward op whose NaN/Inf a later op hid, when the culprit is in backward: the first event in time."""
    from ..replay.result.records import hidden_first  # loaded with the replay that made `result`

    c = result.culprit
    if not hidden_first(c):
        return []
    h = c["hidden"]
    at = f" at {h['source']}" if h["source"] else ""
    return [f"first non-finite op: {h['op']} in {h['module'] or '(no module)'}{at}, forward, {h['precision']}, "
            f"{h['output_kind']} (hidden by a later forward op; it surfaced in backward where the next line says)"]


def _fix_lines(autopsy: AutopsyResult, snapshot: str) -> list[str]:
    fixes = [f for s, f in autopsy.fixes if s == snapshot]
    order = {"verified": 0, "changes_result": 1, "fails": 2, "not_tried": 3}
    lines = []
    for f in sorted(fixes, key=lambda f: order.get(f.status, 3)):
        label = _FIX_LABEL.get(f.status, f.status)
        lines.append(f"{label}: {f.title}" + (f": {f.detail}" if f.detail else ""))
    failing = {f.name for f in fixes if f.status in ("fails", "changes_result")}
    for s, a in autopsy.advice:
        if s != snapshot or (a.fix is not None and a.fix in failing):
            continue  # never word a failing fix as a recommendation
        if a.status == "verified":
            lines.append(f"do (verified above): {a.text}")
        elif a.status == "checked":
            lines.append(f"checked: {a.text}")
        else:
            lines.append(f"untested advice: {a.text}")
    return lines


def _report_only(autopsy: AutopsyResult) -> list[str]:
    rep = autopsy.report
    manual = [s for s in rep.frames.snapshots if s.reason == schema.MANUAL]
    if autopsy.verdict == "healthy":
        lines = [f"root cause: no failing step: the run wrote no failure snapshot, so nothing was replayed; "
                 f"the report says {rep.verdict}"]
    else:
        lines = [f"root cause: not replayed: the run wrote no failure snapshot to replay; the report says "
                 f"{rep.verdict}",
                 "to find the op: record the run with amp-autopsy's Recorder (snapshots on), then run "
                 "analyzer autopsy on it again"]
    if manual:
        lines.append(f"manual snapshots are not failures and are not replayed; to replay one: analyzer replay "
                     f"{manual[0].file}")
    return lines


def _micro_batch_note(autopsy: AutopsyResult) -> list[str]:
    """A replay that found nothing, in a run that accumulates micro-batches the snapshot lacks."""
    meta = (autopsy.report.frames.meta or {}) if autopsy.report is not None else {}
    mb = meta.get("micro_batches")
    if not (isinstance(mb, int) and not isinstance(mb, bool) and mb > 1) or meta.get("micro_batches_kept") is True:
        return []  # no accumulation, or the snapshots hold every micro-batch (format 6)
    return [f"NB: each step of this run accumulates {mb} micro-batches and a snapshot holds the first only "
            "(meta.json micro_batches): the failure may be in a micro-batch the replay did not see"]
# Report findings that are a cause, not a symptom: when one comes no later than the replayed step,
# the answer leads with it and the replay's first non-finite op follows as what it led to.
_CAUSE_CHECKS = ("weights_exploded",)


def _report_cause(autopsy: AutopsyResult) -> Any:
    primary = autopsy.primary
    for f in (autopsy.report.errors if autopsy.report is not None else ()):
        if f.check in _CAUSE_CHECKS and f.step is not None and (
                primary is None or primary.step is None or f.step <= primary.step):
            return f
    return None


def answer_lines(autopsy: AutopsyResult) -> list[str]:
    """Root cause, where, the fixes with their status, then the other picked snapshots in one line each."""
    lines = _replay_lines(autopsy)
    cause = _report_cause(autopsy)
    if cause is None:
        return lines
    head = f"root cause: {cause.check}: {cause.message}"
    if lines and lines[0].startswith("root cause: ") and autopsy.primary is not None:
        lines[0] = f"then, at step {autopsy.primary.step}: " + lines[0][len("root cause: "):]
    return [head] + lines


def _replay_lines(autopsy: AutopsyResult) -> list[str]:
    infos = {p.file: p for p in autopsy.picked}
    primary = autopsy.primary
    if primary is None:
        said = f"the report says {autopsy.report.verdict}" if autopsy.report is not None else "there is no report"
        lines = _report_only(autopsy) if not autopsy.failures else [
            f"root cause: unknown: no picked snapshot could be replayed; {said}"]
    elif primary.culprit is None:
        lines = [f"root cause: {primary.verdict}: {primary.summary}"]
        lines += _micro_batch_note(autopsy)
        lines += _fix_lines(autopsy, primary.snapshot)
    else:
        lines = [f"root cause: {primary.verdict}: {primary.summary}",
                 *_first_nonfinite(primary),
                 _where(primary, infos.get(primary.snapshot))]
        if primary.exception:  # an exception snapshot: what the loop raised at that step
            lines.append(f"raised: {raised_text(primary.exception)}")
        lines += _fix_lines(autopsy, primary.snapshot)
    shared = dict(autopsy.shared)
    for r in (r for r in autopsy.replays if r is not primary):
        info = infos.get(r.snapshot)
        rank, reason = (info.rank, info.reason) if info is not None else (None, None)
        head = f"also step {r.step}, rank {rank} ({reason}): {r.verdict}"
        if r.culprit is not None:
            head += f" at {r.culprit['op']} in {r.culprit['module'] or '(no module)'} ({r.culprit['phase']})"
        if r.snapshot in shared:
            lines.append(head + f"; same culprit as {Path(shared[r.snapshot]).name}, whose fixes apply")
        else:
            lines.append(head)
            lines += ["  " + line for line in _fix_lines(autopsy, r.snapshot)]
    for f in autopsy.failures:
        what = {"replay": "replay", "window": "replay the rewind window of"}.get(f.stage, "try fixes on")
        lines.append(f"could not {what} {f.snapshot}: {f.error}")
    return lines

"""Find the origin op of a run's NaN/Inf by following non-finite values back through producers.

Each op's output gets a *root*: the op where its non-finite values were born.

- An op with finite inputs and a non-finite output is its own root. It is a *literal* root
  when a non-tensor argument was itself NaN/Inf (``masked_fill(mask, -inf)``, ``full(-inf)``,
  a wrapped ``float('-inf')``): a value the user wrote on purpose.
- An op with non-finite inputs inherits the earliest genuine root among them. When all of them
  are literal (a mask value) and the op makes things worse (Inf in, NaN out, e.g. softmax over a
  fully masked row) it becomes the genuine root itself: the mask was fine until this op.

The origin of a failing run is the root of its symptom: the op that produced the loss when the
forward is non-finite, else the first backward op whose non-finite output has a genuine root
(a mask value that backward merely reads back is skipped, whatever op wrote it). Genuine forward
roots that never reach the symptom are reported as *hidden* (an intermediate ``-inf`` that a
later ``where`` hides, and that then breaks backward).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..runs._mode import _OpRecord
from ..result.trace import RunTrace

__all__: list[str] = []

_NO_ALIGN = frozenset({"aten._to_copy", "aten.detach", "aten.alias", "aten.view", "aten._unsafe_view",
                       "aten.t", "aten.transpose", "aten.expand", "aten.clone"})


@dataclass(frozen=True)
class Root:
    index: int | None     # op index; None when the value came from outside any recorded op
    literal: bool


@dataclass
class Origin:
    """The analysis of one failing run."""

    index: int | None
    literal_index: int | None   # the mask-value op an escalating origin consumed
    hidden_index: int | None    # a genuine non-finite op that never reached the symptom


def op_kind(run: RunTrace, rec: _OpRecord) -> int:
    return max((run.kind(s) for s in rec.outputs), default=0)


def op_roots(run: RunTrace) -> list[Root | None]:
    """Per op of `run`, the op its non-finite output comes from (None: finite), kept on the trace."""
    if run.roots is None:
        run.roots = _compute_roots(run)
    return run.roots


def _compute_roots(run: RunTrace) -> list[Root | None]:
    roots: list[Root | None] = []
    for rec in run.records:
        out_k = op_kind(run, rec)
        if out_k == 0:
            roots.append(None)
            continue
        bad = [(run.kind(s), p) for s, p in rec.inputs if run.kind(s) > 0]
        if not bad:
            roots.append(Root(rec.index, rec.literal_nonfinite))
            continue
        # An input that is non-finite with no recorded producer is a constant (a wrapped
        # float('-inf')) or model state / batch (reported separately as nonfinite_input).
        in_roots = [roots[p] if p is not None and roots[p] is not None else Root(None, True) for _, p in bad]
        genuine = [r for r in in_roots if not r.literal]
        if genuine:
            roots.append(min(genuine, key=lambda r: -1 if r.index is None else r.index))
        elif out_k > max(k for k, _ in bad):
            roots.append(Root(rec.index, False))
        else:
            roots.append(in_roots[0])
    return roots


def find_origin(run: RunTrace) -> Origin | None:
    """The origin of `run`'s failure, or None when the run is finite."""
    if run.finite:
        return None
    roots = op_roots(run)
    recs = run.records
    symptom = None
    if not run.forward_finite:
        if run.loss_producer is not None and roots[run.loss_producer] is not None:
            symptom = run.loss_producer
        else:
            symptom = next((r.index for r in reversed(recs) if r.phase == "forward" and roots[r.index]), None)
    if symptom is None:
        # A mask value carried into backward (the -inf a LogsumexpBackward0 reads back from its
        # forward) is an input to the story, not the failure: the symptom is the first backward
        # op whose non-finite output was born in a genuine root.
        symptom = next((r.index for r in recs if r.phase == "backward" and roots[r.index]
                        and not roots[r.index].literal), None)
    if symptom is None:
        symptom = next((r.index for r in recs if r.phase == "backward" and roots[r.index]), None)
    origin = None
    if symptom is not None and roots[symptom] is not None and roots[symptom].index is not None:
        origin = roots[symptom].index
    if origin is None:  # fall back: the first genuine new non-finite value anywhere
        origin = next((r.index for r in recs if roots[r.index] == Root(r.index, False)), None)
    if origin is None:
        origin = next((r.index for r in recs if roots[r.index] is not None), None)
    literal = None
    if origin is not None and recs[origin].inputs:
        for s, p in recs[origin].inputs:
            if run.kind(s) > 0 and p is not None and roots[p] is not None and roots[p].literal:
                literal = roots[p].index
                break
    hidden = None
    if origin is not None:
        hidden = next((r.index for r in recs if r.index < origin and r.phase == "forward"
                       and roots[r.index] == Root(r.index, False)), None)
    return Origin(index=origin, literal_index=literal, hidden_index=hidden)


def align(run: RunTrace, ref: RunTrace) -> dict[int, int]:
    """Map op indices of `run` to the same op in `ref` (another precision of the same step).

    Ops match on (phase, module, op name, occurrence); autocast's casts and pure views are
    skipped because they exist in one precision and not the other.
    """
    def keys(r: RunTrace):
        seen: dict[tuple, int] = {}
        out = {}
        for rec in r.records:
            if rec.name in _NO_ALIGN:
                continue
            k = (rec.phase, rec.module, rec.name)
            n = seen.get(k, 0)
            seen[k] = n + 1
            out[rec.index] = (*k, n)
        return out

    ref_by_key = {v: i for i, v in keys(ref).items()}
    return {i: ref_by_key[k] for i, k in keys(run).items() if k in ref_by_key}


def find_flush(low: RunTrace, ref: RunTrace, origin: int, *, depth: int = 24) -> int | None:
    """The earliest op feeding `origin` whose output has more zeros in `low` than in `ref`.

    Both runs must have been recorded with ``zeros=True``. Returns None when no input of the
    origin gained zeros (no underflow).
    """
    mapping = align(low, ref)

    def excess(i: int) -> bool:
        j = mapping.get(i)
        if j is None:  # a cast: compare what it read instead
            return False
        a, b = low.zero_count(low.records[i]), ref.zero_count(ref.records[j])
        return a is not None and b is not None and a > b

    def producers(i: int) -> list[int]:
        out = []
        for _, p in low.records[i].inputs:
            if p is None:
                continue
            # look through casts and views to the op that computed the value
            while p is not None and low.records[p].name in _NO_ALIGN and low.records[p].inputs:
                p = low.records[p].inputs[0][1]
            if p is not None:
                out.append(p)
        return out

    frontier = [p for p in producers(origin) if excess(p)]
    found = None
    seen: set[int] = set()
    for _ in range(depth):
        if not frontier:
            break
        nxt = []
        for p in frontier:
            if p in seen:
                continue
            seen.add(p)
            up = [q for q in producers(p) if excess(q)]
            if up:
                nxt.extend(up)
            elif found is None or p < found:
                found = p
        frontier = nxt
    if found is None and frontier:  # depth limit reached while zeros kept growing upstream
        found = min(frontier)
    return found

"""Why an overflowing value got large: the op feeding the culprit where the magnitude jumped the most.

An ``overflow`` culprit read finite inputs and produced a value past the dtype's max. The recorded
abs-max of every op's inputs and outputs says where those inputs grew. Among the ops that fed the
culprit (its producers, theirs, and so on), each edge from a value the model computed to the op
that read it has a growth: the abs-max of what that op passed on towards the culprit over the
abs-max of that input. The *jump* is the edge with the largest growth (``q * s`` with
``s = tau.rsqrt() = 316`` multiplies ``q`` by 316). Parameters and buffers are read, not grown:
an edge from one is no jump, and views and casts are looked through. A growth under
``MIN_GROWTH`` explains nothing and is not reported.

When the jump is a ``mul``, its other operand is the *factor*: the op that computed it is named,
with the parameter or buffer it read when exactly one tensor of its module gives the recorded
value (the op re-run on that tensor). The other ``mul`` ops on the way to the culprit that read
the same factor are named with it.

Real output (the demo, ``samples/fp16_attention_overflow.py``: ``tau = 1e-5`` reaches the logits
through ``q * tau.rsqrt()`` and ``k * tau.rsqrt()``)::

    Why so large: the culprit's inputs were multiplied by 316 (aten.mul at samples/models.py:97,
    ops #32 and #33), the aten.rsqrt of `blocks.0.attn.temperature` = 1e-05 (samples/models.py:96,
    op #31): the largest jump in magnitude (x316) among the 41 ops that fed the culprit.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..result.trace import RunTrace

__all__ = ["MIN_GROWTH", "magnitude_jump", "jump_sentence"]

MIN_GROWTH = 10.0  # a jump smaller than this explains nothing about a value past the dtype's max
# Ops that move or re-type values without changing their magnitude: looked through, never a jump.
_THROUGH = frozenset({"aten._to_copy", "aten.detach", "aten.alias", "aten.view", "aten._unsafe_view", "aten.t",
                      "aten.transpose", "aten.expand", "aten.clone", "aten.contiguous", "aten.permute",
                      "aten.reshape", "aten._reshape_alias", "aten.unsqueeze", "aten.squeeze", "aten.lift_fresh",
                      "aten.expand_as", "aten.select", "aten.slice"})
_APPLY = frozenset({"aten.mul", "aten.mul_"})  # a factor multiplied in (a divisor would shrink)
_LIMIT = 20000  # ops visited at most (a deep model's whole forward)


# Growths within 1% of each other are one tie, kept by the earlier op: a few low-precision ulps
# (FP16's is 2**-10) of rounding that moves with the CPU's SIMD must not move the answer.
_TIE = 1e-2


def _ancestors(run: RunTrace, i: int) -> set[int]:
    seen: set[int] = set()
    stack = [p for _, p in run.records[i].inputs if p is not None]
    while stack and len(seen) < _LIMIT:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        stack.extend(q for _, q in run.records[p].inputs if q is not None and q not in seen)
    return seen


def _through(run: RunTrace, p: int | None) -> int | None:
    """The op that computed the value `p` holds, looking through views and casts (None: a leaf)."""
    while p is not None and run.records[p].name in _THROUGH:
        if not run.records[p].inputs:
            return None
        p = run.records[p].inputs[0][1]
    return p


def _passed_on(run: RunTrace, k: int, readers: set[int]) -> float | None:
    """The largest abs-max among op `k`'s outputs that the ops in `readers` read (finite only)."""
    outs = set(run.records[k].outputs)
    vals = [run.absmax[s] for r in readers for s, p in run.records[r].inputs if p == k and s in outs]
    vals = vals or [run.absmax[s] for s in outs]
    out = max(vals, default=None)
    return out if out is not None and math.isfinite(out) else None


def _jump(run: RunTrace, fed: set[int], culprit: int) -> tuple[int, int, float, float, float] | None:
    """(op, input position, growth, input abs-max, abs-max passed on) of the largest edge growth."""
    readers: dict[int, set[int]] = {}
    for r in fed | {culprit}:
        for _, p in run.records[r].inputs:
            if p is not None:
                readers.setdefault(p, set()).add(r)
    best = None
    for k in sorted(fed):
        rec = run.records[k]
        if rec.name in _THROUGH:
            continue
        out = _passed_on(run, k, readers.get(k, set()))
        if out is None:
            continue
        for pos, (s, p) in enumerate(rec.inputs):
            v = run.absmax[s]
            if _through(run, p) is None or not math.isfinite(v) or v <= 0:
                continue  # a parameter, buffer or batch entry is read, not grown
            if best is None or out / v > best[2] * (1 + _TIE):  # a tie keeps the earlier op
                best = (k, pos, out / v, v, out)
    return best


def _factor(run: RunTrace, k: int, pos: int, state: Mapping[str, torch.Tensor] | None) -> dict | None:
    """For a ``mul`` jump, the op that computed its other operand, and the tensor that op read."""
    rec = run.records[k]
    if rec.name not in _APPLY or len(rec.inputs) != 2:
        return None
    s, p = rec.inputs[1 - pos]
    f = _through(run, p)
    if f is None:
        return None
    out = {**_op(run, f), "absmax": run.absmax[s], "reads": None, "reads_absmax": None}
    hit = _read_tensor(run, f, state)
    if hit is not None:
        out["reads"], out["reads_absmax"] = hit
    return out


def _read_tensor(run: RunTrace, f: int, state: Mapping[str, torch.Tensor] | None) -> tuple[str, float] | None:
    """The one tensor of op `f`'s module that, given to the op, reproduces its recorded output abs-max.

    An op reading a 0-d CPU tensor has no recorded input (the mode reads those as numbers), so
    the module's own parameters and buffers are tried as its one argument."""
    rec = run.records[f]
    if not state or not rec.outputs or not rec.module or rec.module.startswith("<"):
        return None
    try:
        op = getattr(getattr(getattr(torch.ops, rec.name.split(".", 1)[0]), rec.name.split(".", 1)[1]), rec.overload)
    except (AttributeError, RuntimeError):
        return None
    if op._schema.is_mutable:  # an in-place op would write the model state: never re-run one
        return None
    want = run.absmax[rec.outputs[0]]
    leaf_in = [run.absmax[s] for s, p in rec.inputs if _through(run, p) is None]
    hits = []
    for name, t in state.items():
        if not (name.startswith(rec.module + ".") and "." not in name[len(rec.module) + 1:]):
            continue
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and 0 < t.numel() <= 4096):
            continue
        if rec.inputs and not (len(leaf_in) == len(rec.inputs) == 1 and _close(float(t.abs().max()), leaf_in[0])):
            continue
        try:
            with torch.no_grad():
                got = op(t.detach().to(torch.float32, copy=True))
        except Exception:  # noqa: BLE001 - an op that needs other arguments: not this tensor
            continue
        if isinstance(got, torch.Tensor) and got.is_floating_point() and _close(float(got.abs().max()), want):
            hits.append((name, float(t.abs().max())))
    return hits[0] if len(hits) == 1 else None


def _close(a: float, b: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 1e-3 * max(abs(a), abs(b))


def _op(run: RunTrace, i: int) -> dict:
    rec = run.records[i]
    return {"op": rec.name, "module": rec.module, "phase": rec.phase, "index": rec.index, "source": rec.source}


def magnitude_jump(run: RunTrace, culprit: int, state: Mapping[str, torch.Tensor] | None = None) -> dict | None:
    """The edge into an op feeding `culprit` in `run` where the magnitude grew the most (None below ``MIN_GROWTH``).

    Returns:
        ``{op, module, phase, index, source, input_absmax, output_absmax, growth, factor, applied_by,
        direct, ops_fed}``: the op, what it read and passed on; ``factor`` (a ``mul`` only) the op
        that computed its other operand, ``{op, module, phase, index, source, absmax, reads,
        reads_absmax}``; ``applied_by`` every ``mul`` on the way to the culprit that read that
        factor; ``direct`` whether they produced the culprit's own inputs; ``ops_fed`` how many ops fed it.
    """
    fed = _ancestors(run, culprit)
    best = _jump(run, fed, culprit)
    if best is None or best[2] < MIN_GROWTH:
        return None
    k, pos, growth, top, out = best
    factor = _factor(run, k, pos, state)
    applied = [k]
    if factor is not None:
        applied = [m for m in sorted(fed) if run.records[m].name in _APPLY
                   and any(_through(run, p) == factor["index"] for _, p in run.records[m].inputs)]
    direct_in = {_through(run, p) for _, p in run.records[culprit].inputs}
    return {**_op(run, k), "input_absmax": top, "output_absmax": out, "growth": growth, "factor": factor,
            "applied_by": [_op(run, m) for m in applied],
            "direct": all(m in direct_in for m in applied), "ops_fed": len(fed)}


def _ops(indices: list[int]) -> str:
    nums = [f"#{i}" for i in indices]
    if len(nums) == 1:
        return f"op {nums[0]}"
    return "ops " + ", ".join(nums[:-1]) + " and " + nums[-1]


def jump_sentence(j: dict | None) -> str:
    """The sentence the ``overflow`` summary adds for a magnitude jump ("" for none)."""
    if not j:
        return ""
    tail = f"the largest jump in magnitude (x{j['growth']:.3g}) among the {j['ops_fed']} ops that fed the culprit."
    f = j["factor"]
    if f is None:
        return (f" Why so large: {j['op']} in `{j['module']}` ({j['source'] or '-'}, op #{j['index']}) took a "
                f"value of abs-max {j['input_absmax']:.3g} to {j['output_absmax']:.3g}: {tail}")
    app = j["applied_by"]
    srcs = sorted({a["source"] for a in app if a["source"]})
    at = f" at {', '.join(srcs)}" if srcs else ""
    whose = "the culprit's inputs were" if j["direct"] else "values on their way to the culprit were"
    of = f" of `{f['reads']}` = {f['reads_absmax']:.3g}" if f["reads"] else ""
    return (f" Why so large: {whose} multiplied by {f['absmax']:.3g} ({app[0]['op']}{at}, "
            f"{_ops([a['index'] for a in app])}), the {f['op']}{of} ({f['source'] or '-'}, op #{f['index']}): {tail}")

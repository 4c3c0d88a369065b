"""Verdict ``cancellation``: a low-precision subtraction cancelled, and a later op took its domain error.

The FP32 run of the step is finite, yet the culprit recomputed in FP32 from its own rounded
inputs is still non-finite: the input was already wrong. A variance ``E[h²] − E[h]²`` of features
near 200 has terms near 4e4, where BF16's spacing is 256, so a true variance of a few units
comes out as -256: ``sqrt`` of it is NaN in any precision. ``find_cancellation`` walks back from
the culprit through the ops that fed it to the ``sub`` / ``rsub`` / ``add`` whose result is a few
units of the spacing of its inputs (every significant digit cancelled), then one more run of
the step captures that op's inputs, so the summary quotes one element: ``47104 − 47360 = −256``.

Recognised patterns name the stable form: the one-pass variance (``torch.var``, two-pass,
Welford) and ``1 − p²`` under a ``sqrt`` (``(1 - p) * (1 + p)``).

Real output (``tests/analyzer/replay/cancel_models.py``, BF16; the summary, cut here)::

    aten.sqrt in `norm` (forward, bfloat16) at tests/analyzer/replay/cancel_models.py:43 produced nan
    from an input that came out negative because aten.sub in `norm` at
    tests/analyzer/replay/cancel_models.py:42 cancelled in bfloat16: 4.3e+04 - 4.33e+04 = -256 (in
    the FP32 run this op's largest |value| is 2.86). Recomputed in FP32 from those rounded inputs ...
"""
from __future__ import annotations

import math

import torch

from ..detection._origin import align
from ..runs._runs import ReplayContext, run_once
from ..result.trace import LOW_PRECISION, RunTrace
from ..result.diagnosis import Diagnosis
from .registry import AdviceLine, Verdict, _keep_fp32, _noted, _where, register

__all__ = ["find_cancellation"]

_CANCEL = ("aten.sub", "aten.rsub", "aten.add")
_THROUGH = ("aten._to_copy", "aten.detach", "aten.alias", "aten.view", "aten._unsafe_view", "aten.expand",
            "aten.clone", "aten.t", "aten.transpose", "aten.squeeze", "aten.unsqueeze", "aten.reshape")
_ELEMENTWISE = _CANCEL + _THROUGH + ("aten.mul", "aten.div", "aten.neg", "aten.clamp", "aten.clamp_min",
                                     "aten.abs", "aten.sqrt", "aten.rsqrt", "aten.pow", "aten.log")
_MANTISSA = {torch.float16: 10, torch.bfloat16: 7}
_SPACINGS = 8  # a result within 8 spacings of its inputs' keeps at most 3 significant bits


def _cancelled(run: RunTrace, i: int) -> bool:
    rec = run.records[i]
    bits = _MANTISSA.get(rec.out_dtype)
    if rec.name not in _CANCEL or bits is None or not rec.inputs or not rec.outputs:
        return False
    big = max(run.absmax[s] for s, _ in rec.inputs)
    out = max(run.absmax[s] for s in rec.outputs)
    if not (math.isfinite(big) and math.isfinite(out)) or big <= 0:
        return False
    spacing = 2.0 ** (math.floor(math.log2(big)) - bits)
    return out <= _SPACINGS * spacing


def _producers(run: RunTrace, i: int) -> list[int]:
    return [p for _, p in run.records[i].inputs if p is not None]


def _through(run: RunTrace, i: int | None) -> int | None:
    """The op that computed `i`'s value, looking through casts and views."""
    while i is not None and run.records[i].name in _THROUGH and run.records[i].inputs:
        i = run.records[i].inputs[0][1]
    return i


def _trace_back(run: RunTrace, origin: int, depth: int = 16) -> int | None:
    """The nearest op feeding `origin` (through elementwise ops) whose result cancelled."""
    frontier, seen = _producers(run, origin), set()
    for _ in range(depth):
        nxt = []
        for p in frontier:
            if p in seen:
                continue
            seen.add(p)
            if _cancelled(run, p):
                return p
            if run.records[p].name in _ELEMENTWISE:
                nxt += _producers(run, p)
        frontier = nxt
    return None


def _square_of(run: RunTrace, i: int | None) -> int | None:
    """For ``x * x`` or ``x ** 2``: the op that made x (its index, or -1 for a leaf); else None."""
    i = _through(run, i)
    if i is None:
        return None
    rec = run.records[i]
    ins = [p for _, p in rec.inputs]
    if rec.name == "aten.mul" and len(ins) == 2 and _through(run, ins[0]) == _through(run, ins[1]):
        return -1 if ins[0] is None else _through(run, ins[0])
    if rec.name == "aten.pow" and ins:
        return -1 if ins[0] is None else _through(run, ins[0])
    return None


def _mean(run: RunTrace, i: int | None) -> int | None:
    i = _through(run, i)
    return i if i is not None and run.records[i].name in ("aten.mean", "aten.sum") else None


def _pattern(run: RunTrace, i: int) -> str | None:
    """``one_pass_variance`` (mean(x*x) - mean(x)**2), ``one_minus_square`` (1 - p*p) or None."""
    rec = run.records[i]
    ins = [p for _, p in rec.inputs]
    if rec.name == "aten.sub" and len(ins) == 2:
        mean_sq = _mean(run, ins[0])  # E[x²]: a mean of a square
        m = _square_of(run, ins[1])   # E[x]²: the square of what made m, itself a mean
        if mean_sq is not None and run.records[mean_sq].inputs \
                and _square_of(run, run.records[mean_sq].inputs[0][1]) is not None \
                and m is not None and m >= 0 and _mean(run, m) is not None:
            return "one_pass_variance"
    if rec.name == "aten.rsub" and len(ins) == 1 and _square_of(run, ins[0]) is not None:
        return "one_minus_square"
    return None


def _example(args, name: str) -> dict | None:
    """One element of the cancelled op: its operands and result, the most negative result first."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if not tensors:
        return None
    scalar = next((a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)), None)
    with torch.no_grad():
        if name == "aten.rsub":
            a = torch.full_like(tensors[0], float(1 if scalar is None else scalar))
            b = tensors[0]
        elif len(tensors) >= 2:
            a, b = torch.broadcast_tensors(tensors[0], tensors[1])
            b = -b if name == "aten.add" else b
        else:
            return None
        res = (a - b).flatten()
        k = int(torch.argmin(res))
        return {"a": float(a.flatten()[k]), "b": float(b.flatten()[k]), "result": float(res[k])}


def find_cancellation(ctx: ReplayContext, low: RunTrace, fp32: RunTrace, origin: int) -> dict | None:
    """The op where the low precision cancelled on the way to `origin`, or None.

    Runs the step once more, capturing that op's inputs, for one element's values.
    """
    if low.precision not in LOW_PRECISION:
        return None
    i = _trace_back(low, origin)
    if i is None:
        return None
    rec = low.records[i]
    j = align(low, fp32).get(i) if fp32.finite else None
    ref = None if j is None else max((fp32.absmax[s] for s in fp32.records[j].outputs), default=None)
    again = run_once(ctx, low.precision, low.scale, capture=i)
    example = _example(again.captured[0], rec.name) if again.captured is not None else None
    return {"op": rec.name, "module": rec.module, "phase": rec.phase, "source": rec.source, "index": rec.index,
            "precision": low.precision,
            "input_absmax": max(low.absmax[s] for s, _ in rec.inputs),
            "output_absmax": max(low.absmax[s] for s in rec.outputs),
            "fp32_output_absmax": ref, "example": example, "pattern": _pattern(low, i)}


# -- the verdict -----------------------------------------------------------------------------------
def _g(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _summary(d: Diagnosis) -> str:
    c = d.culprit
    k = c["cancelled_at"]
    src = f" at {k['source']}" if k.get("source") else ""
    ex = k.get("example")
    values = (f": {_g(ex['a'])} - {_g(ex['b'])} = {_g(ex['result'])}" if ex else
              f": inputs up to {_g(k['input_absmax'])}, result at most {_g(k['output_absmax'])}")
    ref = (f" (in the FP32 run this op's largest |value| is {_g(k['fp32_output_absmax'])})"
           if k.get("fp32_output_absmax") is not None else "")
    sign = ("negative or zero" if ex is None else "negative" if ex["result"] < 0 else "zero" if ex["result"] == 0
            else "wrong")
    return (f"{_where(c)} produced {c['output_kind']} from an input that came out {sign} because "
            f"{k['op']} in `{k['module']}`{src} cancelled in {k['precision']}{values}{ref}. Recomputed in FP32 "
            f"from those rounded inputs the culprit fails too, while the FP32 run of the step is finite: "
            f"the subtraction lost every significant digit to {k['precision']}'s rounding.")


_STABLE = {
    "one_pass_variance": "Compute the variance in one stable call: torch.var(h, dim, unbiased=False) (two-pass: "
                         "((h - m) ** 2).mean(dim) after m = h.mean(dim)), or Welford's update for a running "
                         "variance, instead of E[h²] − E[h]², which cancels when |mean| is large against the std.",
    "one_minus_square": "Write sqrt(1 − p²) as torch.sqrt(((1 - p) * (1 + p)).clamp_min(0)) on p.float(): 1 − p is "
                        "exact near p = 1, where 1 − p*p cancels.",
}


def _advice(d: Diagnosis) -> list[AdviceLine]:
    c = d.culprit
    k = c["cancelled_at"]
    out = []
    if k.get("pattern") in _STABLE:
        out.append(AdviceLine(_STABLE[k["pattern"]]))
    out.append(_keep_fp32(c["module"], d))
    if k["module"] != c["module"] and not k["module"].startswith("<"):
        out.append(AdviceLine(f"Or compute {k['op']} in `{k['module']}`{' at ' + k['source'] if k.get('source') else ''}"
                              " and its operands in FP32 (.float() inputs under torch.autocast(device_type, "
                              "enabled=False))."))
    return out


register(Verdict(
    "cancellation", "The FP32 run is finite; the culprit recomputed in FP32 from its low-precision inputs is not, "
    "because an earlier subtraction cancelled in low precision (a variance E[x²] − E[x]² below 0, 1 − p at 0).",
    summary=_noted(_summary), advice=_advice, fixes=("module_fp32",), precision_advice=True))

"""Probe ``fp32_comparison`` and the verdict ``precision_error``: a finite step that FP16/BF16 got wrong.

Every replayed step whose runs are all finite is compared with the FP32 run replay already made
(``_compare``: the loss, and every parameter's gradient, relative error and cosine; no extra run).
Within tolerance it stays ``healthy`` (the comparison is in ``--json`` as ``fp32_comparison``).
Beyond it, the step is re-run once in its precision with each forward op measured against FP32
(``_born``): the op where the error is born, and once more with that op alone computed in FP32, its
result cast back: how much of the loss and gradient difference is left, so how much it accounts for.
That second run is also the fix ``born_fp32`` (``fixes/_born.py``), judged against FP32.

Real output (``tests/analyzer/replay/finite_error_models.py``: a one-pass variance in BF16 on activations
centred on 8; docs/replay.md reads it)::

    verdict: precision_error
      Every replayed precision is finite, but the bfloat16 step is far from FP32: its loss is 20.3503 against
      FP32's 1.71672 (1.39e+03 eps of bfloat16, tolerance 4), and its gradient is 6.03e+03 eps from FP32's
      (relative error 47.1, cosine 0.497830; tolerance 8 eps). No op computes beyond one rounding from its own
      inputs; the error grows most at aten.sub in `norm` (forward, bfloat16) at
      tests/analyzer/replay/finite_error_models.py:35, from 0.447 eps in its inputs to 83.3 eps in its output: it
      amplifies the rounding of its inputs. With the values it reads made in FP32 from unrounded inputs and kept
      in FP32, the step leaves 0.732 eps on the loss and 3.71 eps on the gradient: that accounts for 100% of the
      loss difference and 100% of the gradient's.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..detection._born import LOCAL_K, Born, OpError, born, measure
from ..detection._compare import Comparison, compare
from ..detection._diagnose import _context_ops, _op_fields
from ..result.records import Culprit
from ..result.trace import LOW_PRECISION, RunTrace
from ..verdicts.registry import AdviceLine, Verdict, _keep_fp32, _where, register
from .registry import ProbeInput, probe

if TYPE_CHECKING:
    from ..result.diagnosis import Diagnosis

__all__ = ["PRECISION_ERROR", "PrecisionCheck", "fp32_comparison"]

PRECISION_ERROR = "precision_error"
_BACKOFFS = 24  # halvings of the loss scale tried for the fixed step, as GradScaler backs off (fixes/_region.py)


@dataclass(frozen=True)
class PrecisionCheck:
    """The step against FP32, and, beyond tolerance, where its error is born and what that op accounts for.

    Attributes:
        comparison: the low-precision run against the FP32 run (``_compare.Comparison``).
        born: the op where the error is born or most amplified (None: within tolerance, or no forward
            op carries the error: it is born in backward, which is not measured).
        fixed: the step re-run with that op alone computed in FP32, against FP32 (None: not run).
        trace / fixed_trace: the measured run and the fixed run (not in the JSON).
    """

    comparison: Comparison
    born: Born | None = None
    fixed: Comparison | None = None
    trace: RunTrace | None = field(default=None, repr=False)
    fixed_trace: RunTrace | None = field(default=None, repr=False)
    kept_fp32: bool = False  # amplified: the values the op reads were made in FP32 and kept so (else: cast back)

    def accounts_for(self) -> dict[str, float | None] | None:
        """The share of the loss and of the gradient difference that computing the op in FP32 removes."""
        if self.fixed is None:
            return None
        c, f = self.comparison, self.fixed
        grad = None if c.grad_rel is None or f.grad_rel is None or c.grad_rel == 0 else 1 - f.grad_rel / c.grad_rel
        loss = None if c.loss_rel == 0 else 1 - f.loss_rel / c.loss_rel
        return {"loss": loss, "grad": grad}

    def born_fields(self) -> dict[str, Any] | None:
        """The culprit's ``precision_error`` entry: the op's errors in eps, and what it accounts for."""
        if self.born is None:
            return None
        e: OpError = self.born.op
        return {"kind": self.born.kind, "local_error_eps": e.local, "error_eps": e.error,
                "input_error_eps": e.input_error, "output_absmax": e.absmax, "fp32_output_absmax": e.fp32_absmax,
                "accounts_for": self.accounts_for(),
                "remaining": None if self.fixed is None else {"loss_error_eps": self.fixed.loss_eps,
                                                              "grad_error_eps": self.fixed.grad_eps}}

    def to_dict(self) -> dict:
        return {"fp32_comparison": self.comparison.to_dict()}


def _applies(d: Diagnosis) -> bool:
    spike = d.evidence.get("spike")
    return d.verdict == "healthy" and d.low in LOW_PRECISION and not (spike is not None and spike.instability)


@probe("fp32_comparison", when=_applies, into="result")
def fp32_comparison(inp: ProbeInput) -> PrecisionCheck | None:
    low, fp32 = inp.runs.get(inp.diagnosis.low), inp.runs.get("float32")
    if low is None or fp32 is None or getattr(inp.snapshot, "compile", None):
        return None  # a compiled step computes otherwise than its eager replay (Inductor fuses in FP32)
    c = compare(low, fp32)
    if c is None or not c.beyond:
        return None if c is None else PrecisionCheck(c)
    trace, errors, _ = measure(inp.ctx, low.precision, low.scale)
    b = born(errors)
    if b is None:
        return PrecisionCheck(c, trace=_plain(trace))
    fixed, kept = _run_fixed(inp, low, trace, errors, b)
    ok = fixed is not None and fixed.finite
    return PrecisionCheck(c, b, compare(fixed, fp32) if ok else None, _plain(trace), _plain(fixed) if ok else None,
                          kept_fp32=kept)


def _plain(trace: RunTrace) -> RunTrace:
    """`trace` without its gradients: the evidence is part of the result, which holds no tensor."""
    return dataclasses.replace(trace, grads=None)


def _run_fixed(inp: ProbeInput, low: RunTrace, trace: RunTrace, errors: list[OpError],
               b: Born) -> tuple[RunTrace | None, bool]:
    """The step with the born op alone in FP32, its result cast back (``computed``), or with the values the op
    reads made from FP32 values upstream (``amplified``; kept in FP32 where the model takes them: the bool)."""
    from ...errors import AnalyzerError
    from ..fixes._hooks import op_fp32_override
    from ..runs._runs import run_once

    i, scale = b.op.index, low.scale
    made, kept = _made_by(trace, errors, i), False
    try:
        for _ in range(_BACKOFFS):  # GradScaler: a finite forward whose backward overflows is skipped, the scale halved
            if b.kind == "amplified":
                fixed, done, kept = _from_fp32_inputs(inp, low.precision, scale, i, made)
            else:
                rec, hits = trace.records[i], []
                fixed = run_once(inp.ctx, low.precision, scale,
                                 op_override=op_fp32_override(i, rec.name, rec.out_dtype, hits))
                done = bool(hits)
            if not done or fixed.finite or not fixed.forward_finite or scale <= 1.0:
                return (fixed if done else None), kept
            scale /= 2
        return fixed, kept
    except AnalyzerError:
        return None, False


def _made_by(trace: RunTrace, errors: list[OpError], i: int) -> frozenset[int]:
    """The forward ops that made op `i`'s inputs carrying an error (they feed every op that reads those values)."""
    err = {e.index: e.error for e in errors}
    return frozenset(p for _s, p in trace.records[i].inputs
                     if p is not None and trace.records[p].phase == "forward" and (err.get(p) or 0) > 0)


def _from_fp32_inputs(inp: ProbeInput, precision: str, scale: float, i: int, made: frozenset[int]):
    """The step with the values op `i` reads made in FP32 from FP32 values upstream and kept in FP32 (so every
    op reading them, not only `i`, computes from them); where the model refuses FP32 there, op `i` alone from
    its inputs' FP32 values, its result cast back."""
    from ...errors import AnalyzerError

    if made:
        try:
            fixed, _, done = measure(inp.ctx, precision, scale, substitute=made, keep_fp32=True)
            if done and fixed.forward_finite:
                return fixed, done, True
        except AnalyzerError:
            pass
    fixed, _, done = measure(inp.ctx, precision, scale, substitute=frozenset({i}))
    return fixed, done, False


# -- the verdict ------------------------------------------------------------------------------------
def _check(d: Diagnosis) -> PrecisionCheck:
    return d.evidence["fp32_comparison"]


def _amend(d: Diagnosis) -> dict:
    ev = _check(d)
    if ev.born is None or ev.trace is None:
        return {"culprit": None, "trace": ev.trace}
    i = ev.born.op.index
    culprit = Culprit(**_op_fields(ev.trace, i), precision_error=ev.born_fields())
    return {"culprit": culprit, "trace": ev.trace, "context_ops": _context_ops(ev.trace, i)}


def _g(v) -> str:
    return "?" if v is None else f"{v:.3g}"


def _pct(v) -> str:
    return "?" if v is None or not math.isfinite(v) else f"{100 * v:.0f}%"


def _summary(d: Diagnosis) -> str:
    ev = _check(d)
    c = ev.comparison
    grad = ("" if c.grad_eps is None else
            f", and its gradient is {_g(c.grad_eps)} eps from FP32's (relative error {_g(c.grad_rel)}, cosine "
            f"{c.grad_cosine:.6f}; tolerance {c.grad_k:g} eps)")
    head = (f"Every replayed precision is finite, but the {c.precision} step is far from FP32: its loss is "
            f"{c.loss:.6g} against FP32's {c.fp32_loss:.6g} ({_g(c.loss_eps)} eps of {c.precision}, tolerance "
            f"{c.loss_k:g}){grad}.")
    cul = d.culprit
    if ev.born is None or cul is None:
        return head + (f" No forward op's output is more than {LOCAL_K:g} eps from FP32: the gradient's error is born "
                       "in backward, which is not measured op by op.")
    e = ev.born.op
    if ev.born.kind == "computed":
        text = (f" The error is born at {_where(cul)}: from its own {c.precision} inputs, recomputed in FP32, its "
                f"output differs by {_g(e.local)} eps (one rounding is at most 0.5).")
    else:
        text = (f" No op computes beyond one rounding from its own inputs; the error grows most at {_where(cul)}, from "
                f"{_g(e.input_error)} eps in its inputs to {_g(e.error)} eps in its output: it amplifies the "
                "rounding of its inputs.")
    acc = ev.accounts_for()
    how = ("Computed alone in FP32 (result cast back), it" if ev.born.kind == "computed" else
           "With the values it reads made in FP32 from unrounded inputs and kept in FP32, the step" if ev.kept_fp32
           else "Computed from the FP32 values of its inputs (everything upstream of it unrounded), it")
    if acc is not None:
        shares = [f"{_pct(acc['loss'])} of the loss difference"] if c.loss_beyond else []
        shares += [f"{_pct(acc['grad'])} of the gradient's"] if c.grad_beyond else []
        text += (f" {how} leaves {_g(ev.fixed.loss_eps)} eps on the loss and {_g(ev.fixed.grad_eps)} eps on the "
                 f"gradient: that accounts for {' and '.join(shares)}.")
    return head + text


def _advice(d: Diagnosis) -> list[AdviceLine]:
    ev, cul = _check(d), d.culprit
    if ev.born is None or cul is None:
        return [AdviceLine("Compare the gradients layer by layer (`fp32_comparison.worst_params` in --json) and keep "
                           "the layers whose gradients differ most in FP32.")]
    where = cul.get("source") or f"`{cul['module']}`"
    if ev.born.kind == "computed":
        out = [AdviceLine(f"Compute {cul['op']} at {where} in FP32: call it on x.float() (and cast the result back "
                          "with .to(x.dtype) where the next op needs it).", ("born_fp32",))]
    else:
        out = [AdviceLine(f"Keep the inputs of {cul['op']} at {where} in FP32 from where they are made: it "
                          f"amplifies their {ev.comparison.precision} rounding.", ("born_fp32",))]
    out.append(_keep_fp32(cul["module"], d))
    return out


register(Verdict(
    PRECISION_ERROR, "Every replayed precision is finite, but the low-precision step's loss or gradients are "
    "beyond tolerance of FP32's; the op where the error is born is named.",
    summary=_summary, advice=_advice, refines=("healthy",),
    detect=lambda d: "fp32_comparison" in d.evidence and _check(d).comparison.beyond, amend=_amend,
    precision_advice=True))

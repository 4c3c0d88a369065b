"""What a fixed step is judged against: the replay's FP32 run of the same step, or plausibility.

A fix is ``verified`` only when its step comes out as FP32 computes it: every gradient finite
and the loss within ``TOLERANCE`` (relative, per the fixed run's precision) of the FP32 run's
loss. A finite step far from it is ``changes_result``: the fix hid the NaN by changing what the
step computes (``sqrt(clamp_min(var, tiny))`` on a variance that cancellation made negative
divides by 1e-19). When the FP32 run is non-finite too there is no reference: the step is then
judged on finiteness and plausibility, a loss at most ``PLAUSIBLE_FACTOR`` times the last finite
loss the run recorded, and the fix's detail says so.

Example:
    >>> j = judge(result, trace)    # the clamp of the one-pass variance, cancel_models.py  # doctest: +SKIP
    >>> j.status, j.loss, j.reference_loss                                                 # doctest: +SKIP
    ('changes_result', 8.46e+17, 1.53)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ...errors import AnalyzerError
from ..detection._compare import Comparison, compare
from ..result.trace import LOW_PRECISION, RunTrace
from ..result.replay_result import ReplayResult

__all__ = ["TOLERANCE", "PLAUSIBLE_FACTOR", "Judgement", "judge", "judge_comparison", "last_finite_loss"]

# Relative tolerance on the loss, by the precision the fixed step ran in: a step in FP16/BF16
# differs from FP32 by the rounding of its activations (measured 5e-6 to 4e-3 relative on the
# test suite's verified fixes), a fix that changes what the step computes by 3e-2 (a clamped
# BCE) to 1e17 (a clamped variance).
TOLERANCE = {"float16": 1e-2, "bfloat16": 1e-2, "float32": 1e-4}
PLAUSIBLE_FACTOR = 10.0


@dataclass(frozen=True)
class Judgement:
    """How a finite fixed step compares with its reference.

    Attributes:
        status: ``verified`` or ``changes_result``.
        detail: the comparison in words (both losses, and gradient abs-maxima where they differ).
        loss: the fixed step's loss.
        reference_loss: FP32's loss, or the last finite recorded loss (None: no reference).
        reference: ``fp32``, ``recorded_loss`` or ``none``.
    """

    status: str
    detail: str
    loss: float
    reference_loss: float | None
    reference: str


def _g(v: float | None) -> str:
    return "?" if v is None else f"{v:.4g}"


def judge(result: ReplayResult, trace: RunTrace, reference: RunTrace | None = None) -> Judgement:
    """Judge the finite run `trace` of a fix against the reference of `result`'s step.

    `reference`: the FP32 run with its gradients (``ReplayContext.fp32_reference``), which a
    ``precision_error`` fix is judged against on every gradient; without it, on the loss alone.
    """
    fp32 = result.traces.get("float32")
    loss = trace.loss
    if result.verdict == "precision_error" and fp32 is not None and fp32.finite:
        return _judge_precision(trace, reference if reference is not None else fp32)
    if fp32 is not None and fp32.finite:
        ref = fp32.loss
        tol = TOLERANCE.get(trace.precision, 1e-2)
        rel = abs(loss - ref) / max(abs(ref), 1e-12)
        cmp = f"loss {_g(loss)} against the FP32 run's {_g(ref)}"
        if rel <= tol:
            return Judgement("verified", f"{cmp} (relative difference {rel:.1g}, within {tol:g})", loss, ref, "fp32")
        grads = ""
        if trace.grad_absmax is not None and fp32.grad_absmax is not None:
            grads = f"; largest |gradient| {_g(trace.grad_absmax)} against FP32's {_g(fp32.grad_absmax)}"
        return Judgement("changes_result", f"finite, but {cmp} (relative difference {rel:.2g}, beyond {tol:g}): "
                         f"the fix changes what the step computes{grads}", loss, ref, "fp32")
    last = last_finite_loss(result)
    none = "the FP32 run is non-finite too, so there is no FP32 reference"
    if last is None:
        return Judgement("verified", f"loss {_g(loss)}; {none} and no finite loss was recorded before this step: "
                         "judged on finiteness alone", loss, None, "none")
    if abs(loss) <= PLAUSIBLE_FACTOR * max(abs(last), 1e-12):
        return Judgement("verified", f"loss {_g(loss)} against the last finite recorded loss {_g(last)}; {none}: "
                         f"judged on finiteness and a loss at most {PLAUSIBLE_FACTOR:g}x that one", loss, last,
                         "recorded_loss")
    return Judgement("changes_result", f"finite, but loss {_g(loss)} is more than {PLAUSIBLE_FACTOR:g}x the last "
                     f"finite recorded loss {_g(last)} ({none}): implausible", loss, last, "recorded_loss")


def _judge_precision(trace: RunTrace, fp32: RunTrace) -> Judgement:
    """A fix of a ``precision_error`` step: verified when its loss and whole gradient are within the
    precision tolerance of FP32's (``_compare``), as the step was not."""
    c = compare(trace, fp32) if trace.precision in LOW_PRECISION else None
    if c is None:  # a fix that ran in FP32: the FP32 run itself
        return Judgement("verified", f"loss {_g(trace.loss)} against the FP32 run's {_g(fp32.loss)}", trace.loss,
                         fp32.loss, "fp32")
    return judge_comparison(c)


def judge_comparison(c: Comparison) -> Judgement:
    """A ``precision_error`` fix's run, already compared with FP32 (``_compare.compare``): verified within tolerance."""
    loss = c.loss
    grad = ("; gradients not compared (no FP32 gradients at hand)" if c.grad_eps is None else
            f", gradient {c.grad_eps:.3g} eps (tolerance {c.grad_k:g})")
    cmp = (f"loss {_g(loss)} against the FP32 run's {_g(c.fp32_loss)}: {c.loss_eps:.3g} eps of {c.precision} "
           f"(tolerance {c.loss_k:g}){grad}")
    if not c.beyond:
        return Judgement("verified", f"{cmp}, within tolerance of FP32", loss, c.fp32_loss, "fp32")
    return Judgement("changes_result", f"{cmp}: still beyond tolerance of FP32", loss, c.fp32_loss, "fp32")


def last_finite_loss(result: ReplayResult) -> float | None:
    """The step's own recorded loss when finite, else the last finite loss the run directory's trace
    holds before the step; None when neither is known (a checkpoint replay, a missing trace)."""
    rec = result.recorded_loss
    if isinstance(rec, float) and math.isfinite(rec):
        return rec
    run_dir = Path(result.snapshot).parent.parent
    if result.step is None or not (run_dir / "meta.json").is_file():
        return None
    import polars as pl

    from ...load import load_run

    try:
        steps = (load_run(run_dir).steps.filter((pl.col("step") < result.step) & pl.col("loss").is_finite())
                 .sort("step").select("loss").collect())
    except (AnalyzerError, pl.exceptions.PolarsError, OSError):
        return None
    return float(steps["loss"][-1]) if steps.height else None

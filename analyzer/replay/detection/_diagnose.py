"""Detection: from a replay's precision runs to a ``Diagnosis`` (which verdict, which op, why).

``diagnose`` reads the runs ``_runs.run_once`` made, re-runs the failing precision once with zero
counts and the culprit's inputs captured, recomputes the culprit in FP32/FP64 (``_shadow``) and
names the verdict. An SDPA culprit whose verdict has ``sdpa_check`` is re-run under each other
attention backend (``try_backends``): ``kernel_specific`` when one of them is finite.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ...errors import AnalyzerError
from ..runs._attribution import source_path
from ..verdicts._cancellation import find_cancellation
from ._origin import align, find_flush, find_origin, op_kind, op_roots
from ..runs._runs import ReplayContext, run_once
from ..result.trace import LOW_PRECISION, RunTrace
from ._shadow import shadow
from .backends import CUDA_ONLY, call_of
from ..result.diagnosis import Diagnosis, PrecisionRun, SdpaCheck
from ..result.records import Culprit, OpRecord, headline
from ..verdicts.registry import VERDICTS

__all__ = ["diagnose", "precision_run", "try_backends", "with_roots"]

_KIND = ("finite", "inf", "nan")


def diagnose(ctx: ReplayContext, runs: dict[str, RunTrace], at_one: dict[str, RunTrace], amp: str | None,
             scale: float, facts: Diagnosis, on_ops=None) -> Diagnosis:
    """The step's ``Diagnosis``: the verdict ``_detect`` reaches, its culprit and what was found around it.

    The probes (``probes/``) add their evidence to it, then the registry refines it
    (``verdicts.refine``): a verdict's ``detect`` may read the evidence.
    """
    return _detect(ctx, runs, at_one, amp, scale, facts, on_ops)


def _detect(ctx: ReplayContext, runs: dict[str, RunTrace], at_one: dict[str, RunTrace], amp: str | None,
            scale: float, facts: Diagnosis, on_ops=None) -> Diagnosis:
    """The verdict of the step, its culprit and what was found around it.

    Args:
        runs: per precision, its run at the recorded loss scale; ``at_one``: the same at scale 1
            where the forward was finite and the backward was not.
        amp: the low precision under test (None for FP32).
        facts: the step's facts (inputs, masks, scale, runs tried, mode) the diagnosis adds to.
    """
    fp32 = runs["float32"]
    origins = {p: find_origin(at_one.get(p) if p in at_one and not at_one[p].finite else r)
               for p, r in runs.items()}
    found = dataclasses.replace(facts, origins=origins)
    inputs = facts.nonfinite_inputs
    if inputs:
        run = runs.get(amp) if amp else fp32
        first = next((rec for rec in run.records
                      if any(p is None and run.kind(s) > 0 for s, p in rec.inputs)), None)
        culprit = Culprit(**_op_fields(run, first.index), input=inputs[0]) if first is not None else None
        return dataclasses.replace(found, verdict="nonfinite_input", culprit=culprit, trace=run,
                                   context_ops=_context_ops(run, first.index if first else None))
    if all(r.finite for r in runs.values()):
        return dataclasses.replace(found, verdict="healthy", culprit=None)
    if not fp32.finite:
        p = "float32"
    else:
        p = amp if amp in runs and not runs[amp].finite else next(q for q, r in runs.items() if not r.finite)
    run = runs[p]
    if run.forward_finite and p in at_one and at_one[p].finite:
        return _finish(found, "loss_scale_overflow", run, _checked(ctx, find_origin(run)))
    eff = at_one[p] if p in at_one else run
    o = _checked(ctx, origins[p])
    # Diagnosis pass: the same step again with zero counts and the origin's inputs captured.
    low = run_once(ctx, p, eff.scale, zeros=True, capture=o.index, on_ops=on_ops)
    if len(low.records) != len(eff.records) or low.records[o.index].name != eff.records[o.index].name:
        raise AnalyzerError(
            f"two replays of the same step in {p} ran different ops, so the culprit cannot be pinned",
            path=ctx.path, fix="make the model's forward deterministic (no data-dependent randomness "
            "outside torch's RNG) and replay again")
    rec = low.records[o.index]
    low_dtype = getattr(torch, p) if p in LOW_PRECISION else None
    sh = shadow(rec.name, rec.overload, low.captured, low_dtype)
    underflow_at = cancelled_at = None
    if p == "float32":
        verdict = "numerical_bug"
    elif rec.namespace not in ("aten", "prims") and any(_dname(d) in LOW_PRECISION for d in rec.in_dtypes):
        verdict = "unregistered_op"
    elif sh["float32"] is not None and math.isfinite(sh["float32"]):
        verdict = "overflow"
    else:
        ref = run_once(ctx, "float32", eff.scale, zeros=True, on_ops=on_ops)
        flush = find_flush(low, ref, o.index)
        verdict = "numerical_bug" if flush is None else "underflow"
        underflow_at = None if flush is None else _flush_record(low, ref, flush)
        cancelled_at = find_cancellation(ctx, low, fp32, o.index) if flush is None else None
        verdict = "cancellation" if cancelled_at is not None else verdict
    sdpa = None
    call = call_of(low.sdpa_calls, rec) if VERDICTS[verdict].sdpa_check else None
    if call is not None:  # an SDPA culprit: the same step under each other attention backend
        sdpa = SdpaCheck(call.backend, try_backends(ctx, p, eff.scale, call.backend, on_ops=on_ops),
                         (ctx.sdpa or {}).get("math_reduced_precision"))
        verdict = "kernel_specific" if sdpa.finite else verdict
    return _finish(dataclasses.replace(found, sdpa=sdpa), verdict, low, o, shadow_=sh, ref=fp32,
                   underflow_at=underflow_at, cancelled_at=cancelled_at)


def try_backends(ctx: ReplayContext, precision: str, scale: float, ran: str | None, *,
                 on_ops=None) -> dict[str, str]:
    """Replay the step in `precision` once under each SDPA backend other than `ran`.

    Returns:
        ``{backend: "finite" | "nonfinite at OP in `MODULE`" | "unavailable: why"}`` for each of
        ``math``, ``flash`` (CPU has a fused flash kernel), ``mem_efficient`` and ``cudnn``.
    """
    out: dict[str, str] = {}
    for backend in ("math", "flash", "mem_efficient", "cudnn"):
        if backend == ran:
            continue
        if ctx.device.type != "cuda" and backend in CUDA_ONLY:
            out[backend] = "unavailable: CUDA only"
            continue
        try:
            run = run_once(ctx, precision, scale, sdpa_backend=backend, on_ops=on_ops)
        except AnalyzerError as e:  # "No viable backend ...": this kernel cannot take these inputs
            out[backend] = f"unavailable: {_why(e)}"
            continue
        if run.finite:
            out[backend] = "finite"
            continue
        origin = find_origin(run)
        rec = run.records[origin.index] if origin is not None and origin.index is not None else None
        out[backend] = f"nonfinite at {rec.name} in `{rec.module}`" if rec is not None else "nonfinite"
    return out


def _why(e: AnalyzerError) -> str:
    text = str(e.__cause__ or e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:160]


def with_roots(traces) -> None:
    """Work out, once, where each op's non-finite output came from, on every trace (``RunTrace.roots``)."""
    for t in traces:
        if t is not None:
            op_roots(t)


def _checked(ctx, origin):
    if origin is None or origin.index is None:
        raise AnalyzerError("the replay is non-finite but no recorded op produced the NaN/Inf", path=ctx.path,
                            fix="please report this with the snapshot")
    return origin


def _finish(found: Diagnosis, verdict: str, run: RunTrace, o, *, shadow_=None, ref=None,
            underflow_at=None, cancelled_at=None) -> Diagnosis:
    extra: dict = {"shadow": None if shadow_ is None else {
        "float32": shadow_["float32"], "float64": shadow_["float64"],
        "dtype_max": float(torch.finfo(getattr(torch, run.precision)).max),
        "error": shadow_["error"],
    }}
    if ref is not None and ref is not run:
        j = align(run, ref).get(o.index)
        extra["fp32_output_absmax"] = None if j is None else _out_absmax(ref, j)
    literal = _op_record(run, o.literal_index) if o.literal_index is not None else None
    hidden = _op_record(run, o.hidden_index) if o.hidden_index is not None else None
    if underflow_at is not None:
        extra["underflow_at"] = underflow_at
    if cancelled_at is not None:
        extra["cancelled_at"] = cancelled_at
    culprit = Culprit(**_op_fields(run, o.index), literal_nonfinite=literal, hidden=hidden, **extra)
    center = headline(culprit)["index"]  # around the op the answer leads with, as the text's table
    return dataclasses.replace(found, verdict=verdict, culprit=culprit, literal=literal, hidden=hidden,
                               underflow_at=underflow_at, trace=run, context_ops=_context_ops(run, center))


def _dname(dtype) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _out_absmax(run: RunTrace, i: int) -> float | None:
    vals = [run.absmax[s] for s in run.records[i].outputs]
    return _nan_max(vals)


def _nan_max(vals: list[float]) -> float | None:
    if not vals:
        return None
    if any(math.isnan(v) for v in vals):
        return float("nan")
    return max(vals)


def _op_record(run: RunTrace, i: int) -> OpRecord:
    return OpRecord(**_op_fields(run, i))


def _op_fields(run: RunTrace, i: int) -> dict:
    rec = run.records[i]
    return {
        "op": rec.name, "overload": rec.overload, "module": rec.module, "phase": rec.phase,
        "precision": run.precision, "index": rec.index, "source": rec.source, "node": rec.node,
        "input_dtypes": sorted(_dname(d) for d in rec.in_dtypes), "output_dtype": _dname(rec.out_dtype),
        "input_absmax": _nan_max([run.absmax[s] for s, _ in rec.inputs]),
        "output_absmax": _out_absmax(run, i),
        "output_kind": _KIND[op_kind(run, rec)],
        "custom": rec.namespace not in ("aten", "prims"),
        "source_path": source_path(rec.source),
    }


def _flush_record(low: RunTrace, ref: RunTrace, i: int) -> OpRecord:
    j = align(low, ref).get(i)
    return OpRecord(**_op_fields(low, i), zeros=low.zero_count(low.records[i]),
                    fp32_zeros=None if j is None else ref.zero_count(ref.records[j]))


def _context_ops(run: RunTrace, center: int | None, half: int = 4) -> tuple[OpRecord, ...]:
    if center is None:
        return ()
    lo, hi = max(0, center - half), min(len(run.records), center + half + 1)
    return tuple(_op_record(run, i) for i in range(lo, hi))


def precision_run(run: RunTrace, at_one: RunTrace | None, origin) -> PrecisionRun:
    """One precision's run as ``ReplayResult.runs`` holds it."""
    first = None
    if origin is not None and origin.index is not None:
        src = at_one if at_one is not None and not at_one.finite else run
        if origin.index < len(src.records):
            rec = src.records[origin.index]
            first = {"index": rec.index, "op": rec.name, "module": rec.module, "phase": rec.phase,
                     "source": rec.source}
    extra = {}
    if at_one is not None:
        extra["finite_at_scale_1"] = at_one.finite
    if run.emulated_cuda_ops:
        extra["emulated_cuda_fp32_calls"] = run.emulated_cuda_ops
    return PrecisionRun(finite=run.finite, loss=run.loss, loss_dtype=run.loss_dtype,
                        forward_finite=run.forward_finite, backward_finite=run.grads_finite,
                        grad_absmax=run.grad_absmax, scale=run.scale, ops=len(run.records),
                        first_nonfinite=first, **extra)

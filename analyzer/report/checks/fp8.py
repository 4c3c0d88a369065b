"""The FP8 casts the recorder measured (format 8): ``fp8_casts``, an operand whose cast flushed or saturated too much.

With ``Recorder(fp8_every=N)`` a run of a torchao FP8 model records, every N-th step, each FP8 module's input,
weight and grad_output cast as its recipe casts them, once per GEMM that reads the operand (its ``use``: ``forward``,
``input gradient``, ``weight gradient``; ``recorders/_fp8_watch.py``, the ``fp8`` trace parts). This check names
each module, operand role and use whose flushed fraction (non-zero values that became 0) or saturated
fraction (values beyond the format's max before the clamp) passed the run's limits (meta.json's ``fp8``: 5% and
0.01%), with the steps it did so. Runs without FP8 casts, and casts within the limits, get no finding.

Real output (the SwiGLU block of tests/recorders/test_fp8_watch.py whose w1/w3 rows align, torchao tensorwise)::

    fp8_casts @ step 0: block.mlp.w2 input (forward GEMM, e4m3 tensorwise): up to 97.9% of its non-zero values
    flushed to zero, at 4 of 4 measured steps (steps 0-3; limits 5% flushed, 0.01% saturated); amax 2e+04. One
    scale set by its largest values ...

How to read it: a tensorwise scale is ``448 / amax``; every value below about ``amax / 2.3e5`` flushes. An amax far
above the operand's typical values (one outlier channel) flushes most of it: rowwise scaling, or keeping that
module in BF16 (``module_filter_fn``), keeps them; ``analyzer fp8-readiness`` on a snapshot shows which recipe does.
"""
from __future__ import annotations

from ...findings import Finding
from .frames import Frames, fp8_limits

__all__ = ["fp8_casts"]


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def _amax(x: float | None) -> str:
    return "" if x is None else f"; amax {x:.3g}"


def _cause(r: dict) -> str:
    """Why a cast flushes, and what keeps its values: true of its granularity (a rowwise cast is rowwise already)."""
    if r["granularity"] == "tensorwise":
        return ("One scale set by its largest values puts the small ones below the format's smallest subnormal; "
                "rowwise scaling or keeping this module in BF16 (module_filter_fn) keeps them")
    group = "row" if r["granularity"] == "rowwise" else "block of 32"
    wider = ("; e5m2 gradients cover a wider range" if r["role"] == "grad_output" and r["format"] == "e4m3" else "")
    return (f"The scale of each {group} ({r['use']} GEMM's axis) is set by its largest values and puts the small ones "
            f"below the format's smallest subnormal; keeping this module in BF16 (module_filter_fn) keeps them{wider}")


def fp8_casts(frames: Frames) -> list[Finding]:
    """One warning per (rank, module, role, use) whose FP8 cast passed the flushed or saturated limit at a measured
    step."""
    if frames.fp8 is None:
        return []
    flush, sat = fp8_limits(frames.meta)
    out = []
    for r in frames.fp8.filter(frames.fp8["n_over"] > 0).iter_rows(named=True):
        what = []
        if r["flushed"] is not None and r["flushed"] > flush:
            what.append(f"up to {_pct(r['flushed'])} of its non-zero values flushed to zero")
        if r["saturated"] is not None and r["saturated"] > sat:
            what.append(f"up to {_pct(r['saturated'])} of its values saturated (beyond {r['format']}'s max)")
        steps = f"step {r['first']}" if r["first"] == r["last"] else f"steps {r['first']}-{r['last']}"
        cause = _cause(r) if r["flushed"] is not None and r["flushed"] > flush else \
            "Its scale did not cover its largest values"
        msg = (f"{r['module']} {r['role']} ({r['use']} GEMM, {r['format']} {r['granularity']}): "
               f"{' and '.join(what)}, at "
               f"{r['n_over']} of {r['measured']} measured steps ({steps}; limits {_pct(flush)} flushed, "
               f"{_pct(sat)} saturated){_amax(r['amax'])}. {cause}")
        out.append(Finding("fp8_casts", "warning", r["first"], msg,
                           {"module": r["module"], "role": r["role"], "use": r["use"], "format": r["format"],
                            "granularity": r["granularity"], "first_step": r["first"], "last_step": r["last"],
                            "steps_over": r["n_over"], "steps_measured": r["measured"],
                            "max_flushed_frac": r["flushed"], "max_saturated_frac": r["saturated"],
                            "amax": r["amax"], "flush_limit": flush, "saturate_limit": sat},
                           rank=r["rank"] if frames.n_ranks > 1 else None))
    return out

"""The FP8 verdicts: ``fp8_underflow`` and ``fp8_saturation``, found in the FP8 probe's evidence.

Both refine a step that FP32 and the run's own precision replay finite (``healthy``, ``not_reproduced``)
and that the FP8 replay (``fp8/diagnose.py``) finds broken: a cast beyond a limit *and* a step that no
longer agrees with BF16. Neither blames an op (the step is finite): their fixes are tried on the FP8 step
all the same (``Verdict.without_culprit``) and judged against BF16 (``fp8/fixes.py``).

Real output (``analyzer replay`` on the aligned SwiGLU of ``tests/analyzer/replay/fp8/``, tensorwise)::

    verdict: fp8_underflow
    In FP8 (e4m3 tensorwise), `block.mlp.w2`'s input (forward GEMM, forward pass) flushed 97.9% of its
    4030 non-zero values to zero: its scale was set by the outlier at channel 5 (row 3, |x| = 1.98e+04); ...
"""
from __future__ import annotations

from ..result.diagnosis import Diagnosis
from ..verdicts.registry import AdviceLine, Verdict, register
from .diagnose import Fp8Evidence, breaking
from .step import OUT_REL_TOL
from .recipe import filter_source

__all__ = ["UNDERFLOW", "SATURATION", "NONFINITE", "CHANNEL_GAP", "keep_high", "e5m2_applies"]

UNDERFLOW, SATURATION, NONFINITE = "fp8_underflow", "fp8_saturation", "fp8_nonfinite"
# the aligned-channel pattern (Smooth-SwiGLU applies): one input channel's amax at least 10x every other's
CHANNEL_GAP = 10.0


def _ev(d: Diagnosis) -> Fp8Evidence | None:
    ev = d.evidence.get("fp8")
    return ev if isinstance(ev, Fp8Evidence) else None


def keep_high(ev: Fp8Evidence) -> list[str]:
    """The modules whose casts break (or whose cast flushed the values an FP8-born NaN came from), in step
    order: what the keep-in-BF16 fix leaves out of FP8."""
    n = ev.nonfinite_cast
    return list(dict.fromkeys(c.module for c in ev.casts if (breaking(c) or c is n) and c.module in ev.modules))


def _where(ev: Fp8Evidence) -> str:
    c = ev.first
    return (f"In FP8 ({c.fmt} {c.granularity}), `{c.module}`'s {c.role or 'operand'} "
            f"({c.use or 'no'} GEMM, {c.phase} pass)")


def _damage(ev: Fp8Evidence) -> str:
    j = ev.jump
    if j is not None:
        prev = j["previous"]
        before = f"; `{prev['layer']}` before it: {prev['rel_err']:.3f}" if prev and prev["rel_err"] is not None else ""
        out = (f"against BF16, `{j['layer']}`'s output is {j['rel_err']:.3f} off on the median token "
               f"(tolerance {OUT_REL_TOL}{before})")
    else:
        out = "against BF16 every Linear output is within the tolerance"
    g = ev.grad_jump
    grad = (f"; the gradient error first passes the tolerance at `{g['name']}` (cosine {g['cosine']:.4f}, "
            f"relative error {g['rel_err']:.3f})" if g is not None and g["rel_err"] is not None else "")
    return f"{out}{grad}; {ev.vs_bf16.numbers()}."


def _underflow(d: Diagnosis) -> str:
    ev = _ev(d)
    c, s = ev.first, ev.first.stats
    if c.granularity.startswith("mxfp8"):  # a scale per block of 32: each block's largest value set its own
        why = (f"each block of 32's scale was set by its largest value (the largest: channel {c.outlier[1]}, "
               f"row {c.outlier[0]}, |x| = {s.amax:.3g})")
    else:
        why = f"its scale was set by the outlier at channel {c.outlier[1]} (row {c.outlier[0]}, |x| = {s.amax:.3g})"
    return f"{_where(ev)} flushed {s.flushed_frac:.1%} of its {s.nonzero} non-zero values to zero: {why}; {_damage(ev)}"


def _saturation(d: Diagnosis) -> str:
    ev = _ev(d)
    c, s = ev.first, ev.first.stats
    return (f"{_where(ev)} saturated {s.saturated} of {s.numel} values ({s.saturated_frac:.2%}) beyond {c.fmt}'s "
            f"max under a scale that does not cover them (amax {s.amax:.3g}, scale {s.scale_max:.3g}); {_damage(ev)}")


def _nonfinite(d: Diagnosis) -> str:
    ev = _ev(d)
    n, c = ev.nonfinite_at, ev.nonfinite_cast
    text = (f"Only the FP8 step is non-finite (FP32 and BF16 are finite): the first NaN/Inf is made by {n['op']} in "
            f"`{n['module']}` ({n['phase']} pass)")
    if c is None:
        return text + "; no FP8 cast before it flushed or saturated a value."
    s = c.stats
    what = (f"flushed {s.flushed} of its {s.nonzero} non-zero values ({s.flushed_frac:.1%}) to zero" if s.flushed
            else f"saturated {s.saturated} of {s.numel} values beyond {c.fmt}'s max")
    return (f"{text}. The last FP8 cast before it that lost values: `{c.module}`'s {c.role or 'operand'} "
            f"({c.use or 'no'} GEMM, {c.phase} pass, {c.fmt} {c.granularity}) {what}; its scale was set by "
            f"|x| = {s.amax:.3g} at channel {c.outlier[1]} (row {c.outlier[0]}).")


def _advice(d: Diagnosis) -> list[AdviceLine]:
    ev = _ev(d)
    c = ev.first if d.verdict != NONFINITE else ev.nonfinite_cast
    if c is None:
        return [AdviceLine(f"Keep the modules in BF16 when converting, or guard {ev.nonfinite_at['op']} in "
                           f"`{ev.nonfinite_at['module']}` with an epsilon.")]
    lines = []
    if e5m2_applies(c):
        lines.append(AdviceLine("Cast the gradients to e5m2 (its max is 128x e4m3's and its smallest subnormal 128x "
                                "smaller).", fixes=("fp8_e5m2_grads",)))
    lines.append(AdviceLine("Scale FP8 casts per row (torchao's rowwise recipe): an outlier then sets only its own "
                            "row's scale.", fixes=("fp8_rowwise",)))
    lines.append(AdviceLine(f"Keep {', '.join(keep_high(ev))} in BF16 when converting: {filter_source(keep_high(ev))}",
                            fixes=("fp8_keep_bf16",)))
    if d.verdict == NONFINITE:
        lines.append(AdviceLine(f"Guard {ev.nonfinite_at['op']} in `{ev.nonfinite_at['module']}` with an epsilon: "
                                "an FP8 cast can make a whole row exactly zero."))
    if d.verdict == UNDERFLOW and c.role == "input" and c.channel_gap >= CHANNEL_GAP:
        lines.append(AdviceLine(f"Smooth the channels of `{c.module}`'s input (Smooth-SwiGLU): a per-channel scale "
                                "before it, folded inversely into its weight's columns.", fixes=("fp8_smooth_swiglu",)))
    if c.granularity == "mxfp8_floor":
        lines.append(AdviceLine("Round the MX block scales up (MXFP8TrainingOpConfig(scale_calculation_mode="
                                "ScaleCalculationMode.RCEIL)): each block's amax then fits e4m3's 448.",
                                fixes=("fp8_mxfp8",)))
    elif not _all_mx(d):  # an MXFP8 (RCEIL) recipe is already that
        lines.append(AdviceLine("Train these Linears in MXFP8 (a scale per block of 32).", fixes=("fp8_mxfp8",)))
    return lines


def e5m2_applies(c) -> bool:
    """Whether casting gradients to e5m2 can help the broken cast `c`: an e4m3 grad_output of a torchao float8
    recipe (torchao 0.18's MXFP8 training casts every operand to e4m3, with no option for its gradients)."""
    return c is not None and c.role == "grad_output" and c.fmt == "e4m3" and not c.granularity.startswith("mxfp8")


def _all_mx(d: Diagnosis) -> bool:
    ev = _ev(d)
    return ev is not None and ev.mxfp8


def _detects(name: str):
    return lambda d: (ev := _ev(d)) is not None and ev.verdict == name


_FIXES = ("fp8_e5m2_grads", "fp8_rowwise", "fp8_keep_bf16", "fp8_smooth_swiglu", "fp8_mxfp8")
register(Verdict(UNDERFLOW, "An FP8 cast whose scale an outlier set flushed most of an operand to zero, and the "
                 "step no longer agrees with BF16.", summary=_underflow, advice=_advice, fixes=_FIXES,
                 refines=("healthy", "not_reproduced"), detect=_detects(UNDERFLOW), without_culprit=True))
register(Verdict(SATURATION, "An FP8 cast passed the format's max under a scale that does not cover the values, "
                 "and the step no longer agrees with BF16.", summary=_saturation, advice=_advice, fixes=_FIXES,
                 refines=("healthy", "not_reproduced"), detect=_detects(SATURATION), without_culprit=True))
register(Verdict(NONFINITE, "Only the FP8 step is non-finite (FP32 and BF16 are finite): its first NaN/Inf op, "
                 "and the FP8 cast before it that flushed the values.", summary=_nonfinite, advice=_advice,
                 fixes=_FIXES, refines=("healthy", "not_reproduced"), detect=_detects(NONFINITE), without_culprit=True))

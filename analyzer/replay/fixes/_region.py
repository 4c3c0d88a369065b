"""The ``region_fp32`` fix: the value kept in FP32 from the cast that made it FP16/BF16 to the culprit.

The ``small_input`` probe names the cast upstream of an overflowing reciprocal, division, ``rsqrt``,
``log`` or negative power (``sigma.to(pred.dtype)`` before ``1 / sigma**2``). The fix re-runs the step
with that one ``aten._to_copy`` returning its FP32 input unchanged: every op after it that autocast does
not cast (elementwise maths) then runs in FP32, up to the culprit and past it. It is judged against the
FP32 run like any fix (loss and every gradient). Judged as the run's GradScaler would: when the forward
is finite and only the backward overflows at the recorded scale (a large weight on the loss makes the
FP16 gradients large), the step is re-run at the scale GradScaler backs off to, halving, and a fix
verified there says so (``max_safe_scale``).
"""
from __future__ import annotations

from ..runs._runs import ReplayContext
from .registry import Fix, FixSpec, _attempt, _culprit_run, _judge, register_fix
from ..result.replay_result import ReplayResult

__all__ = ["NAME"]

NAME = "region_fp32"
_BACKOFFS = 24  # halvings tried: from 65536 down to 1/256


def _region(ctx: ReplayContext, result: ReplayResult) -> Fix | None:
    ev = result.evidence.get("small_input")
    if ev is None or ev.cast is None or result.culprit is None:
        return None
    c, cast = result.culprit, ev.cast
    prec, scale = _culprit_run(result)
    title = (f"keep the value in FP32 from the cast at {cast['source'] or cast['op']} to {c['op']} at "
             f"{c.get('source') or c['module']} (that cast skipped)")
    hits: list[int] = []

    def keep_fp32(_func, args, _kwargs):  # the cast's FP32 input, unchanged: the region runs in FP32
        hits.append(1)
        return args[0].clone()

    out = _attempt(ctx, result, NAME, title, prec, scale, op_override={cast["index"]: keep_fp32})
    if isinstance(out, Fix):
        return out
    if not hits:
        return Fix(name=NAME, title=title, status="not_tried", precision=prec,
                   detail=f"this run's op #{cast['index']} was not the cast: the step ran different ops")
    backed_off = scale
    for _ in range(_BACKOFFS):  # GradScaler: a finite forward whose backward overflows is skipped, the scale halved
        if out.finite or not out.forward_finite or backed_off <= 1.0:
            break
        backed_off /= 2
        nxt = _attempt(ctx, result, NAME, title, prec, backed_off, op_override={cast["index"]: keep_fp32})
        if isinstance(nxt, Fix):
            return nxt
        out = nxt
    if backed_off == scale:
        return _judge(result, NAME, title, out)
    note = (f" (at the recorded loss scale {scale:g} its FP16 backward overflows: GradScaler skips those steps and "
            f"backs off to {backed_off:g}, where it is judged)")
    return _judge(result, NAME, title, out, note=note, max_safe_scale=backed_off if out.finite else None)


def _line(fix: Fix, c, _mode: str) -> str:
    scale = (f" The step is verified at the loss scale GradScaler backs off to, {fix.max_safe_scale:g}: at the recorded "
             "one its FP16 backward overflows and that step is skipped." if fix.max_safe_scale is not None else "")
    return f"Keep the value in FP32 there: {fix.title.removeprefix('keep the value in FP32 ')}.{scale}"


register_fix(FixSpec(NAME, "the value kept in FP32 from the cast that made it low precision to the culprit",
                     _region, serves=("overflow",), line=_line))

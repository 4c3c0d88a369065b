"""The ``born_fp32`` fix: the op where a finite step's error is born computed alone in FP32, its result cast back.

For an op that only amplifies the rounding of its inputs (``kind="amplified"``), the values it reads made from
FP32 values upstream and kept in FP32, so every op reading them computes from them (where the model refuses
FP32 values there: the op alone from its inputs' FP32 values, cast back): the step as if the code upstream of
it ran in FP32.

The ``fp32_comparison`` probe (``probes/precision.py``) already re-ran the step that way to measure how
much of the difference the op accounts for; the fix judges that run against FP32 (loss and whole
gradient within the precision tolerance, ``_reference.judge``) instead of running it again.
"""
from __future__ import annotations

from ._reference import judge_comparison
from ..runs._runs import ReplayContext
from .registry import Fix, FixSpec, _judge, register_fix
from ..result.replay_result import ReplayResult

__all__ = ["NAME"]

NAME = "born_fp32"


def _born_fp32(_ctx: ReplayContext | None, result: ReplayResult) -> Fix | None:
    ev = result.evidence.get("fp32_comparison")
    c = result.culprit
    if ev is None or ev.born is None or c is None:
        return None
    where = f"{c['op']} in `{c['module']}` at {c.get('source') or c['module']}"
    if ev.born.kind == "computed":
        title = f"compute {where} alone in FP32, its result cast back to {c['precision']}"
    elif ev.kept_fp32:
        title = f"make the values {where} reads in FP32 (every op upstream of them unrounded) and keep them in FP32"
    else:
        title = (f"compute {where} from the FP32 values of its inputs (every op upstream of it), its result cast "
                 f"back to {c['precision']}")
    if ev.fixed_trace is None or ev.fixed is None:
        return Fix(name=NAME, title=title, status="not_tried", precision=c["precision"],
                   detail="the step with this op in FP32 did not run to the end (the op was not at its index, or "
                          "the step raised)")
    t, j = ev.fixed_trace, judge_comparison(ev.fixed)
    if t.scale != result.scale:
        note = (f" (at the recorded loss scale {result.scale:g} its FP16 backward overflows: GradScaler skips those "
                f"steps and backs off to {t.scale:g}, where it is judged)")
        return _judge(result, NAME, title, t, note=note, judgement=j, max_safe_scale=t.scale)
    return _judge(result, NAME, title, t, judgement=j)


def _line(fix: Fix, c, _mode: str) -> str:
    where = c.get("source") or f"`{c['module']}`"
    if (c.get("precision_error") or {}).get("kind") == "amplified":
        return (f"Compute the inputs of {c['op']} at {where} in FP32 from where they are made (call that code on "
                ".float() values): it amplifies their rounding; verified on this step.")
    return (f"Compute {c['op']} at {where} in FP32: call it on x.float() and cast the result back with .to(x.dtype) "
            "where the next op needs it.")


register_fix(FixSpec(NAME, "the op where the error is born computed alone in FP32, its result cast back", _born_fp32,
                     serves=("precision_error",), line=_line, needs_model=False))

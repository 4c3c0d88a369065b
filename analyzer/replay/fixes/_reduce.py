"""``reduce_fp32``: a culprit born in a collective (a gradient reduction that left its ``reduce_dtype``'s range
while every rank's input was finite) re-run with the reduction in FP32.

Only a context that reduces gradients across ranks can apply it: the distributed replay's
``ShardedContext`` (FSDP2: ``reduce_dtype=float32`` in every ``MixedPrecisionPolicy``) and
``ReplicatedContext`` (DDP: the all-reduce without the compress hook), each naming the change in
``reduce_fp32_title`` and applying it while ``reduce_override`` is set. The fixed step is judged as
every fix is (``registry._judge``: finite, and within the tolerance of this rank's FP32 run); the
ranks then agree on its status (``distributed.lockstep.agree_fixes``).

Example (on every rank, ``distributed.lockstep.fix_reduction``):
    >>> [(f.name, f.status) for f in run_fixes(result, lambda: ctx)]   # doctest: +SKIP
    [('reduce_fp32', 'verified')]
"""
from __future__ import annotations

from collections.abc import Mapping

from .registry import FixSpec, Fix, _attempt, _judge, register_fix

__all__ = ["reduce_fp32"]


def reduce_fp32(ctx, result) -> Fix | None:
    """The step again with the gradients reduced in FP32; None where `ctx` reduces nothing (one process)."""
    title = getattr(ctx, "reduce_fp32_title", None)
    if title is None:
        return None
    precision = result.culprit["precision"]
    ctx.reduce_override = "float32"
    try:
        out = _attempt(ctx, result, "reduce_fp32", title, precision, result.scale)
    finally:
        ctx.reduce_override = None
    return out if isinstance(out, Fix) else _judge(result, "reduce_fp32", title, out)


def _reduced_in_low_precision(_verdict: str, culprit: Mapping) -> bool:
    return culprit["collective"].get("reduce_dtype") != "float32"


register_fix(FixSpec("reduce_fp32", "the gradients reduced in FP32", reduce_fp32, serves=("overflow",),
                     line=lambda fix, _c, _mode: fix.title, applies=_reduced_in_low_precision,
                     acts_on=("collective",)))

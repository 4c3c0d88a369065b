"""FP8 probe: a step trained with an FP8 recipe is replayed in FP32, BF16 and FP8, and the casts that broke are named.

It applies where the replay found nothing in FP32 and the run's own precision (``healthy`` or
``not_reproduced``: FP8's failures are mostly silent) and the snapshot's step trained in FP8
(``ReplayContext.fp8_recipe``: the snapshot's ``fp8_recipe`` entry, or a factory that returns a converted
model). The work is ``fp8/diagnose.py``; its evidence goes into ``replay --json`` as the ``fp8`` key and
is what the ``fp8_underflow`` and ``fp8_saturation`` verdicts detect themselves in (``fp8/verdicts.py``).
"""
from __future__ import annotations

from ..fp8.diagnose import Fp8Evidence, fp8_diagnosis
from .registry import ProbeInput, probe

__all__ = ["fp8"]


@probe("fp8", when=lambda d: d.verdict in ("healthy", "not_reproduced"), into="result")
def fp8(inp: ProbeInput) -> Fp8Evidence | None:
    if inp.ctx.fp8_recipe is None:
        return None
    return fp8_diagnosis(inp.ctx, inp.ctx.mode.dtype or "float32")

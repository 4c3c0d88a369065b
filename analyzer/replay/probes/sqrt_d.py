"""Probe ``sqrt_d``: an overflowing matmul of attention logits, checked against division by sqrt(head_dim).

``head_dim`` is the contraction dimension of the culprit's captured inputs (``_attention``); the
check says whether the largest logit, recomputed in FP32, fits the dtype once divided by it. The
``overflow`` advice writes its sqrt(head_dim) line from this evidence (or says it is not enough).
It reads the captured inputs here, while the replay holds them: the result never carries them.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..detection._attention import sqrt_d_check
from .registry import ProbeInput, probe

if TYPE_CHECKING:
    from ..result.diagnosis import Diagnosis

__all__ = ["SqrtD", "sqrt_d"]


@dataclass(frozen=True)
class SqrtD:
    """``head_dim``, ``logit_absmax``, ``scaled_absmax``, ``dtype_max`` and whether it ``fits``."""

    check: Mapping[str, Any]

    def to_dict(self) -> dict:
        return {"sqrt_d": dict(self.check)}


def _applies(d: Diagnosis) -> bool:
    return d.verdict == "overflow" and d.culprit is not None and d.trace is not None


@probe("sqrt_d", when=_applies)
def sqrt_d(inp: ProbeInput) -> SqrtD | None:
    check = sqrt_d_check(inp.diagnosis)
    return None if check is None else SqrtD(check)

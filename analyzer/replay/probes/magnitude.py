"""Probe ``magnitude_jump``: for an ``overflow``, the op feeding the culprit where the magnitude jumped the most.

The search itself is ``_magnitude.magnitude_jump`` (the module doc there shows real output); the
culprit's ``magnitude_jump`` field and the overflow summary's "Why so large" sentence read this
evidence.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..detection._magnitude import magnitude_jump
from .registry import ProbeInput, probe

if TYPE_CHECKING:
    from ..result.diagnosis import Diagnosis

__all__ = ["MagnitudeJump", "jump"]


@dataclass(frozen=True)
class MagnitudeJump:
    """The jump (``_magnitude.magnitude_jump``'s mapping: op, module, index, growth, factor...)."""

    jump: Mapping[str, Any]

    def to_dict(self) -> dict:
        return {"magnitude_jump": self.jump}


def _applies(d: Diagnosis) -> bool:
    return d.verdict == "overflow" and d.culprit is not None and d.trace is not None


@probe("magnitude_jump", when=_applies, into="culprit")
def jump(inp: ProbeInput) -> MagnitudeJump | None:
    d = inp.diagnosis
    j = magnitude_jump(d.trace, d.culprit["index"], inp.ctx.model_state)
    return None if j is None else MagnitudeJump(j)

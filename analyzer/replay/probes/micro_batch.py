"""Probe ``micro_batch``: in a step that accumulated gradients, the micro-batch the failure belongs to.

The culprit op's index in the trace of all micro-batches names its micro-batch
(``RunTrace.micro_starts``); a broken batch entry ``batch:2.x`` names micro-batch 2 itself, and a
broken weight belongs to none. The culprit's ``micro_batch`` field and the summary's last sentence
come from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..runs._accumulate import input_micro, micro_of
from .registry import ProbeInput, probe

if TYPE_CHECKING:
    from ..result.diagnosis import Diagnosis

__all__ = ["MicroBatch", "micro_batch"]


@dataclass(frozen=True)
class MicroBatch:
    """The micro-batch (0-based) of `count` the failure happened in."""

    index: int
    count: int

    def to_dict(self) -> dict:
        return {"micro_batch": self.index}

    def note(self) -> str:
        return f"It is in micro-batch {self.index} (0-based) of the {self.count} this step accumulated."


def _applies(d: Diagnosis) -> bool:
    return d.verdict != "healthy"


@probe("micro_batch", when=_applies, into="culprit")
def micro_batch(inp: ProbeInput) -> MicroBatch | None:
    micro, d = inp.ctx.micro, inp.diagnosis
    if micro is None:
        return None
    if d.verdict == "nonfinite_input":  # a broken weight belongs to no micro-batch; a batch entry does
        index = input_micro(d.nonfinite_inputs[0], micro["count"]) if d.nonfinite_inputs else None
    else:
        index = micro_of(d.trace, d.culprit["index"]) if d.culprit is not None else None
    return None if index is None else MicroBatch(index, micro["count"])

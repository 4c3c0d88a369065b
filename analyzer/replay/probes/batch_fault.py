"""Probe ``batch_fault``: what is wrong with the batch when the culprit is the loss's own 0/0.

An HF batch whose every label is the ignore index (-100) has no target tokens, so
``cross_entropy(reduction="sum") / num_items_in_batch`` is 0/0 (``_actionable.batch_fault`` says
when). The summary then names the batch as the cause, and the advice says to skip such batches first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..detection._actionable import BATCH_FAULT_ADVICE, batch_fault
from .registry import ProbeInput, probe

if TYPE_CHECKING:
    from ..result.diagnosis import Diagnosis

__all__ = ["BatchFault", "fault", "BATCH_FAULT_ADVICE"]


@dataclass(frozen=True)
class BatchFault:
    """What is wrong with the batch, in one clause (``every label is -100 in the batch entry ...``)."""

    what: str

    def to_dict(self) -> dict:
        return {"batch_fault": self.what}

    def note(self) -> str:
        return f"The cause is the batch: {self.what}."


def _applies(d: Diagnosis) -> bool:
    return d.culprit is not None


@probe("batch_fault", when=_applies)
def fault(inp: ProbeInput) -> BatchFault | None:
    d = inp.diagnosis
    what = batch_fault(inp.ctx.batch, d.culprit, d.trace)
    return None if what is None else BatchFault(what)

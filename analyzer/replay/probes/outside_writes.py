"""Probe ``outside_writes``: NaN/Inf weights that the recomputed optimizer update does not explain.

A snapshot whose weights are already NaN/Inf (verdict ``nonfinite_input``) and whose optimizer
state is saved: each such parameter's update is recomputed (``update.written_outside``); one
whose update is finite and too small to reach the dtype's max was written outside the optimizer.
The summary names the first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..update.forensics import OUTSIDE_NOTE, written_outside
from .registry import ProbeInput, probe

if TYPE_CHECKING:
    from ..result.diagnosis import Diagnosis

__all__ = ["OutsideWrites", "outside_writes"]


@dataclass(frozen=True)
class OutsideWrites:
    """The parameters NaN/Inf that no recomputed update explains, in the snapshot's order."""

    params: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"written_outside": list(self.params)}

    def note(self) -> str:
        return f"NB: {self.params[0]}: {OUTSIDE_NOTE}."


def _applies(d: Diagnosis) -> bool:
    return d.verdict == "nonfinite_input"


@probe("outside_writes", when=_applies)
def outside_writes(inp: ProbeInput) -> OutsideWrites | None:
    found = written_outside(inp.path, inp.snapshot)
    return OutsideWrites(tuple(found)) if found else None

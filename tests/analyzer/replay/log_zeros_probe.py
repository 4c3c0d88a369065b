"""A throwaway probe and the verdict it makes possible, defined outside the package (``test_probe_example.py``).

The probe ``log_zeros`` counts the exact zeros a culprit ``aten.log`` read (its captured inputs,
while the replay holds them); the verdict ``log_of_zeros_test`` narrows ``numerical_bug`` when
that evidence is there, and its summary and advice read the count from ``Diagnosis.evidence``.
Importing this module registers both: that is the whole change a new kind of evidence needs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from analyzer.replay import AdviceLine, ProbeInput, Verdict, probe, register

__all__ = ["LogZeros", "log_zeros", "VERDICT"]

VERDICT = "log_of_zeros_test"


@dataclass(frozen=True)
class LogZeros:
    """How many of the log's input elements were exactly 0."""

    zeros: int
    numel: int

    def to_dict(self) -> dict:
        return {"log_zeros": {"zeros": self.zeros, "numel": self.numel}}

    def note(self) -> str:
        return f"The log read {self.zeros} exact zero(s) among {self.numel} value(s)."


def _applies(d) -> bool:
    return d.verdict == "numerical_bug" and d.culprit is not None and d.culprit["op"] == "aten.log"


@probe("log_zeros", when=_applies, into="result")
def log_zeros(inp: ProbeInput) -> LogZeros | None:
    captured = inp.diagnosis.trace.captured if inp.diagnosis.trace is not None else None
    if captured is None:
        return None
    x = next(a for a in captured[0] if isinstance(a, torch.Tensor))
    return LogZeros(int((x == 0).sum()), x.numel())


register(Verdict(
    VERDICT, "A log read exact zeros (a verdict defined in a test, from a probe's evidence).",
    summary=lambda d: (f"{d.culprit['op']} in `{d.culprit['module']}` read "
                       f"{d.evidence['log_zeros'].zeros} exact zero(s)."),
    advice=lambda d: [AdviceLine(f"Clamp the {d.evidence['log_zeros'].zeros} zero(s) away before the log.",
                                 fixes=("guard_clamp",))],
    fixes=("guard_clamp",), refines=("numerical_bug",), detect=lambda d: "log_zeros" in d.evidence))

"""Finding: one diagnosis (check name, severity, step, message, evidence), a frozen value.

Checks (``analyzer.report.checks``), ``analyzer inspect`` and replay share it (a top-level module: no
analysis package imports another to get it). They return lists of findings; the report
sorts and renders them. ``to_dict()`` is strict-JSON safe: NaN and infinities in the evidence
become the strings ``"nan"``, ``"inf"`` and ``"-inf"``, so ``json.dumps(allow_nan=False)`` works.

Example:
    >>> f = Finding("nonfinite_loss", "error", 120, "loss became NaN at step 120", {"loss": float("nan")})
    >>> f.to_dict()["evidence"]
    {'loss': 'nan'}
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Finding", "SEVERITIES", "EXIT_FAIL_ON", "exit_status", "json_safe", "safe_text", "sort_findings"]

SEVERITIES = ("error", "warning", "info")  # most severe first
_RANK = {s: i for i, s in enumerate(SEVERITIES)}
EXIT_FAIL_ON = 4  # --fail-on SEVERITY matched: a finding that severe or worse is present (every command)


def safe_text(text: str) -> str:
    """`text` with lone surrogates (``"\\udcff"`` read from a JSON file) written as escapes: encodable.

    Example:
        >>> safe_text("layer\\udcff.weight")
        'layer\\\\udcff.weight'
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def json_safe(obj: Any) -> Any:
    """Recursively turn `obj` into strict-JSON values (non-finite floats -> "nan"/"inf"/"-inf").

    numpy / torch scalars become Python numbers, tuples become lists, unknown objects ``str()``,
    and strings are made encodable (``safe_text``).
    """
    if isinstance(obj, str):
        return safe_text(obj)
    if obj is None or isinstance(obj, bool):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, Mapping):
        return {safe_text(str(k)): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in obj]
    item = getattr(obj, "item", None)  # numpy / torch scalars
    if callable(item) and getattr(obj, "ndim", 1) == 0:
        return json_safe(item())
    if hasattr(obj, "tolist"):
        return json_safe(obj.tolist())
    return safe_text(str(obj))


@dataclass(frozen=True)
class Finding:
    """One diagnosis.

    Attributes:
        check: stable name of the check, e.g. ``"scale_collapse"`` (a public contract).
        severity: ``"error"``, ``"warning"`` or ``"info"``.
        step: the first step involved, or None when the finding is not tied to a step.
        message: plain words a person can act on.
        evidence: the numbers behind the message (JSON-able after ``json_safe``).
        rank: the rank the finding is about, or None (single process or all ranks).
    """

    check: str
    severity: str
    step: int | None
    message: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    rank: int | None = None

    def __post_init__(self):
        if not self.check or not isinstance(self.check, str):
            raise ValueError(f"check must be a non-empty string, got {self.check!r}")
        if self.severity not in _RANK:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")
        if self.step is not None and not isinstance(self.step, int):
            object.__setattr__(self, "step", int(self.step))
        object.__setattr__(self, "evidence", dict(self.evidence))
        object.__setattr__(self, "message", safe_text(str(self.message)))  # text from files, printable

    def to_dict(self) -> dict[str, Any]:
        """A strict-JSON dict: check, severity, step, rank, message, evidence."""
        return {
            "check": self.check,
            "severity": self.severity,
            "step": self.step,
            "rank": self.rank,
            "message": self.message,
            "evidence": json_safe(self.evidence),
        }


def sort_findings(findings: Iterable[Finding]) -> list[Finding]:
    """Most severe first, then by step (findings without a step last), then by check name."""
    return sorted(
        findings,
        key=lambda f: (_RANK[f.severity], f.step is None, f.step or 0, f.check, f.rank or 0),
    )


def exit_status(findings: Iterable[Finding], fail_on: str | None) -> int:
    """``--fail-on``: EXIT_FAIL_ON when a finding of severity `fail_on` ("error" or "warning") or
    worse is among `findings`, else 0 (also when `fail_on` is None)."""
    if not fail_on:
        return 0
    if fail_on not in _RANK:
        raise ValueError(f"fail_on must be one of {SEVERITIES}, got {fail_on!r}")
    return EXIT_FAIL_ON if any(_RANK[f.severity] <= _RANK[fail_on] for f in findings) else 0

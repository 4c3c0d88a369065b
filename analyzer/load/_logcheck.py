"""Values a foreign log cannot hold, collected while it is read, so that the report names them.

A log written by a training framework holds numbers where it holds a loss, a loss scale or an
iteration count, and as many fields per CSV row as its header. A cell that is not a number, a
loss scale that is not a positive finite number, a count of iterations that is not a whole number
within its log interval, or a CSV row with too many or too few fields means the log was edited,
damaged or written by something else. The importer keeps reading (the rest of the log is still
evidence) and records each such value here; the synthesised meta carries them under
``LOG_PROBLEMS`` and the report's ``implausible_trace`` check names them in a warning.
"""
from __future__ import annotations

import math

__all__ = ["LOG_PROBLEMS", "Problems", "count", "number_cell", "scale_value", "to_float", "short"]

LOG_PROBLEMS = "log_problems"  # key of an imported log's meta: {"count": n, "examples": [...]}
_KEEP = 8  # examples kept; the count covers all


def short(v) -> str:
    """A value as the message shows it: quoted, control characters visible, at most 40 characters."""
    return repr(str(v)[:40])


def to_float(v) -> float | None:
    """A number from a cell or token (``"nan"`` and ``"inf"`` included); None when it is not one."""
    if v is None or v == "" or isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError, OverflowError):
        return None


class Problems:
    """The implausible values of one log: how many, and the first few, each ``"where: what"``."""

    def __init__(self) -> None:
        self.n = 0
        self.examples: list[str] = []

    def add(self, where: str, what: str) -> None:
        self.n += 1
        if len(self.examples) < _KEEP:
            self.examples.append(f"{where}: {what}")

    def __bool__(self) -> bool:
        return self.n > 0

    def first(self) -> str:
        """The first problem in parentheses, for an error that the problems may explain."""
        return f" ({self.examples[0]})" if self.examples else ""

    def to_meta(self) -> dict:
        return {"count": self.n, "examples": list(self.examples)}


def number_cell(v, where: str, what: str, bad: Problems) -> float | None:
    """A numeric cell: None when empty (a column this row does not log); a cell that holds something
    else than a number is named in `bad` and read as None."""
    if v is None or v == "":
        return None
    x = to_float(v)
    if x is None:
        bad.add(where, f"{what} {short(v)} is not a number")
    return x


def scale_value(tok, where: str, what: str, bad: Problems) -> float | None:
    """A loss scale: positive and finite (GradScaler and DeepSpeed's scaler never log 0, a negative
    scale or inf); anything else is named in `bad` and read as unknown."""
    x = to_float(tok)
    if x is None or not (math.isfinite(x) and x > 0):
        bad.add(where, f"{what} {short(tok)} is not a positive finite number")
        return None
    return x


def count(tok, bound: int, where: str, what: str, bad: Problems) -> int:
    """A count of iterations within a log interval of `bound` iterations: a whole number in
    ``[0, bound]``; anything else (``nan``, ``inf``, ``1e999``, ``2.5``, more than the interval) is
    named in `bad` and read as 0."""
    if tok is None:
        return 0
    x = to_float(tok)
    if x is None or not math.isfinite(x) or x != int(x) or not 0 <= x <= bound:
        bad.add(where, f"{what} {short(tok)} is not a whole count of the interval's {bound} iteration(s) "
                       "(read as 0)")
        return 0
    return int(x)

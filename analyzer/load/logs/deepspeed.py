"""DeepSpeed text logs: ``[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: X,
reducing to Y``, ``step=N, skipped=K`` and ``steps: N loss: L`` lines.

The patterns are linear in the line: each starts with a literal and no two adjacent quantifiers
can match the same character (no possessive quantifiers: Python 3.10 has none); the scales are read from the text after their labels, so an overflow line whose
scale is unreadable, or that lacks one, is still a skipped step and its problem is named.
"""
from __future__ import annotations

import re
from pathlib import Path

import polars as pl

from ...errors import BadInputError
from .._logcheck import Problems, number_cell, scale_value, short
from ..run import Run
from ._common import I64, RUN_HINT, to_run, whole
from ._registry import register_log_importer

__all__ = ["import_deepspeed"]

_OVERFLOW = re.compile(r"OVERFLOW!\s+Rank\s+(\d+)\s+Skipping step")
_STEP = re.compile(r"\bstep=(\d+),\s*skipped=(\d+)")
_LOSS = re.compile(r"\bsteps:\s*(\d+)\s+loss:\s*([-+\w.]+)")
_ATTEMPTED, _REDUCED = "Attempted loss scale:", "reducing to"


def _sniff(line: str) -> bool:
    return bool(_OVERFLOW.search(line) or _LOSS.search(line))


def _scales(rest: str, where: str, bad: Problems) -> tuple[float | None, float | None]:
    """The attempted and reduced scales of an overflow line's text after "Skipping step"; a missing
    or unreadable one is named in `bad` and read as unknown."""
    _, found, tail = rest.partition(_ATTEMPTED)
    if not found:
        bad.add(where, f"overflow line without {_ATTEMPTED!r} (scale unknown)")
        return None, None
    attempted, comma, tail = tail.partition(",")
    tok = attempted.strip()
    if not comma or not tail.lstrip().startswith(_REDUCED):
        bad.add(where, f"overflow line without ', {_REDUCED} Y' after the attempted scale {short(tok)}")
        return scale_value(tok, where, "attempted loss scale", bad), None
    reduced = tail.lstrip()[len(_REDUCED):].lstrip()
    reduced = reduced.split(None, 1)[0].split(",", 1)[0] if reduced.strip() else ""
    return (scale_value(tok, where, "attempted loss scale", bad),
            scale_value(reduced, where, "reduced loss scale", bad))


@register_log_importer("deepspeed_log", order=40, sniff=_sniff)
def import_deepspeed(path: Path, lines: list[str]) -> Run:
    """DeepSpeed counts skipped steps in global_steps, so an overflow line is one step."""
    step, scale, rows, bad = 0, None, {}, Problems()
    for i, line in enumerate(lines, 1):
        if m := _OVERFLOW.search(line):
            if whole(m[1], path, "rank", 0, 2**31) != 0:
                continue  # rank 0 speaks for the data-parallel group: the scaler is synchronised
            step += 1
            attempted, scale = _scales(line[m.end():], f"line {i}", bad)
            rows[step] = {"step": step, "scale": attempted, "skipped": True, "loss": None}
        elif m := _STEP.search(line):
            step = whole(m[1], path, "step", 0, I64 >> 1)
        elif m := _LOSS.search(line):
            step = whole(m[1], path, "step", 0, I64 >> 1)
            r = rows.setdefault(step, {"step": step, "scale": scale, "skipped": False})
            # float() reads "nan" and "inf" as DeepSpeed prints them
            r["loss"] = number_cell(m[2], f"line {i}", "loss", bad)
    if not rows:
        raise BadInputError("no DeepSpeed 'OVERFLOW!' or 'steps: N loss:' lines", path=path, fix=RUN_HINT)
    df = pl.DataFrame(list(rows.values()), schema={"step": pl.Int64, "scale": pl.Float64,
                                                   "skipped": pl.Boolean, "loss": pl.Float64})
    return to_run(path, "deepspeed_log", df.with_columns(rank=pl.lit(0)), amp_dtype="float16",
                  growth_interval=1000, bad=bad,
                  notes=["DeepSpeed log: only logged steps and overflow lines are known; "
                         "growth interval assumed to be loss_scale_window's default, 1000"])

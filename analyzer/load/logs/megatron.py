"""Megatron-LM text logs: ``iteration N/ M | ... | lm loss: L | loss scale: S | grad norm: G |
number of skipped iterations: K | number of nan iterations: J |`` (one line per log interval).

Linear in the line: no two adjacent quantifiers of the iteration pattern can match the same
character, and each ``|`` field is
split at its first ``:`` rather than matched by a pattern whose name and spaces overlap.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import polars as pl

from .._logcheck import Problems, count, number_cell, scale_value
from ..run import Run
from ._common import I64, to_run, whole
from ._registry import register_log_importer

__all__ = ["import_megatron"]

# the iteration as any token, so that "nan" or "1e999" is refused rather than the line skipped
_MEG = re.compile(r"iteration\s+([-+]?[\w.]+)\s*/\s*[-+]?[\w.]+\s*\|(.*)")
_NAME = re.compile(r"[a-zA-Z][\w \-()/]*")
_VALUE = re.compile(r"[-+\w.]+")
_NUMBERS = ("loss scale", "grad norm", "learning rate")


def _sniff(line: str) -> bool:
    return bool(_MEG.search(line))


def _fields(text: str) -> dict[str, str]:
    """``name: value`` of each ``|`` field whose name and value look like Megatron's."""
    fields = {}
    for chunk in text.split("|"):
        name, colon, value = chunk.partition(":")
        name, value = name.strip(), value.strip()
        if colon and _NAME.fullmatch(name) and _VALUE.fullmatch(value):
            fields[name.lower()] = value
    return fields


@register_log_importer("megatron_log", order=50, sniff=_sniff)
def import_megatron(path: Path, lines: list[str]) -> Run:
    rows, prev, bad = [], 0, Problems()
    for i, line in enumerate(lines, 1):
        m = _MEG.search(line)
        if not m:
            continue
        it, where = whole(m[1], path, f"line {i}: iteration", 0, I64), f"line {i}"
        fields = _fields(m[2])
        n_iter = max(1, it - prev)
        loss = next((number_cell(v, where, k, bad) for k, v in fields.items() if k.endswith("loss") and "scale" not in k),
                    None)
        nums = {k: number_cell(fields.get(k), where, k, bad) for k in _NUMBERS}
        if nums["loss scale"] is not None:
            nums["loss scale"] = scale_value(fields["loss scale"], where, "loss scale", bad)
        if count(fields.get("number of nan iterations"), n_iter, where, "number of nan iterations", bad):
            loss = math.nan  # Megatron averages only finite losses; a nan count is a non-finite loss
        skipped = count(fields.get("number of skipped iterations"), n_iter, where, "number of skipped iterations", bad)
        rows.append({"step": it, "loss": loss, "scale": nums["loss scale"], "grad_norm": nums["grad norm"],
                     "lr": nums["learning rate"], "skipped": skipped > 0, "n_iter": n_iter, "n_skipped": skipped})
        prev = it
    df = pl.DataFrame(rows, schema={"step": pl.Int64, "loss": pl.Float64, "scale": pl.Float64,
                                    "grad_norm": pl.Float64, "lr": pl.Float64, "skipped": pl.Boolean,
                                    "n_iter": pl.Int64, "n_skipped": pl.Int64})
    amp = "float16" if df["scale"].drop_nulls().len() else None
    return to_run(path, "megatron_log", df.with_columns(rank=pl.lit(0)), amp_dtype=amp, growth_interval=1000, bad=bad,
                  notes=["Megatron log: one row per log interval (losses are interval averages); "
                         "growth interval assumed to be --loss-scale-window's default, 1000"])

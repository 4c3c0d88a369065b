"""``Run``: a run opened for reading (a recorder run directory or an imported foreign log).

Both readers (``run_dir`` and ``logs``) build one; the report reads only this.
"""
from __future__ import annotations

import math

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from recorders import schema

from .._terminal import escape_controls

__all__ = ["Run", "SnapshotInfo", "progress_line", "step_frame"]


_INFO_KEYS = ("file", "step", "rank", "reason", "writer", "why")


@dataclass(frozen=True)
class SnapshotInfo:
    """One snapshot file as its name describes it (``run_dir.snapshot_info``); no file is opened.

    Attributes:
        file: the snapshot's path, as listed.
        step, rank, reason: parsed from ``schema.SNAPSHOT_RE``; None when the name does not parse.
        writer: the writer number (0: the rank's first process); None when the name does not parse.
        why: why the autopsy replays it (``autopsy.pick_snapshots``); None for a snapshot not picked.
    """

    file: str
    step: int | None = None
    rank: int | None = None
    reason: str | None = None
    writer: int | None = None
    why: str | None = None

    def __getitem__(self, key: str) -> Any:
        """``info["step"]``: the field, read as the JSON object's key (code that reads the snapshot list as dicts)."""
        if key not in _INFO_KEYS or (key == "why" and self.why is None):
            raise KeyError(key)
        return getattr(self, key)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (``report --json``'s ``snapshots``, ``autopsy --json``'s ``picked``)."""
        return {k: getattr(self, k) for k in _INFO_KEYS if k != "why" or self.why is not None}


@dataclass
class Run:
    """A run opened for reading. ``steps``/``layers`` are lazy; ``meta`` is rank 0's meta.json.

    Attributes:
        path: the directory or file given.
        source_format: ``"amp-autopsy"`` or the importer's name (``"hf_trainer_state"``, ...).
        meta: rank 0's meta (synthesised for imported logs: amp_dtype, scaler, params may be empty).
        metas: meta per rank.
        steps: LazyFrame with ``schema.STEP_COLUMNS`` (plus ``n_iter``/``n_skipped`` for logs
            whose rows cover several iterations).
        layers: LazyFrame with ``schema.LAYER_COLUMNS``, or None when the source has no layer table.
        params: parameter names in model order (``layer`` indexes this list).
        numels: element count per parameter, or None where unknown.
        snapshots: snapshot files, sorted by step.
        notes: caveats the report must repeat (partial run, what an imported log lacks,
            several processes that wrote one rank).
        partial: True when the run was cut short (killed process, missing parts).
        writers: for each rank in the frames that is not a real rank: ``(rank, writer)``, the
            rank an extra process also claimed and its writer number. Its steps keep their own
            stream (this rank number in the frames), so they never mix with the first writer's.
        shards: for an FSDP2 run (version 3), ``(rank, layer, local_numel)`` of every sharded
            parameter: ``layers`` rows are then pieces of parameters, merged by
            ``analyzer.load.shards.merge_shards``; None for every other run.
        diagnose: for a run directory, names the damaged part when a query over the trace failed:
            decodes the parts (streaming) and raises ``BadInputError`` naming the first that does
            not decode or holds a null key (step, rank, layer); returns when every part is sound.
            Load reads only footers, so a corrupt data page is found by the first query that
            reads it (``analyzer.report.checks.frames``). None for imported logs (read in full).
        fp8: LazyFrame with ``schema.FP8_COLUMNS`` (version 8: the FP8 casts of the steps the recorder measured),
            or None when the run has no fp8 parts (no FP8 module, an older run, an imported log).
    """

    path: Path
    source_format: str
    meta: dict[str, Any]
    metas: dict[int, dict[str, Any]]
    steps: pl.LazyFrame
    layers: pl.LazyFrame | None
    params: list[str] = field(default_factory=list)
    numels: list[int | None] = field(default_factory=list)
    snapshots: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    partial: bool = False
    writers: dict[int, tuple[int, int]] = field(default_factory=dict)
    shards: pl.DataFrame | None = None
    diagnose: Callable[[], None] | None = None
    fp8: pl.LazyFrame | None = None

    @property
    def world_size(self) -> int:
        """The recorded world size (1 when unknown)."""
        ws = self.meta.get("world_size")
        return ws if isinstance(ws, int) and not isinstance(ws, bool) and ws >= 1 else 1

    @property
    def amp_dtype(self) -> str | None:
        """The run's AMP dtype; None (FP32) also when the recorder saw autocast off during the forward."""
        seen = self.meta.get("autocast")
        if isinstance(seen, dict) and seen.get("enabled") is False:
            return None
        return schema.dtype_name(self.meta.get("amp_dtype"))

    @property
    def growth_interval(self) -> int:
        """GradScaler growth interval from the scaler config (2000, torch's default, if unknown)."""
        scaler = self.meta.get("scaler") or {}
        gi = scaler.get("growth_interval", 2000) if isinstance(scaler, dict) else 2000
        # NaN, inf, 0, 2.5 or a string: not a GradScaler's (implausible_trace names it); the default is used
        ok = (isinstance(gi, (int, float)) and not isinstance(gi, bool) and math.isfinite(gi) and gi == int(gi)
              and 0 < gi < 2**31)
        return int(gi) if ok else 2000

    @property
    def ranks(self) -> list[int]:
        return sorted(self.metas) or [0]


def progress_line(enabled: bool, text: str) -> None:
    if enabled:
        print(f"[amp-autopsy] {escape_controls(text)}", file=sys.stderr, flush=True)


def step_frame(df: pl.DataFrame) -> pl.DataFrame:
    """Give an imported frame every ``STEP_COLUMNS`` column (nulls where unknown), schema dtypes."""
    out = []
    for c, t in schema.STEP_COLUMNS.items():
        out.append(pl.col(c).cast(t, strict=False) if c in df.columns else pl.lit(None, dtype=t).alias(c))
    # n_iter/n_skipped: rows covering several iterations; loss_filtered: HF's logging_nan_inf_filter
    extra = [pl.col(c) for c in ("n_iter", "n_skipped", "loss_filtered") if c in df.columns]
    return df.select(out + extra).sort("rank", "step")

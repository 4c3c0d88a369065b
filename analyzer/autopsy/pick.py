"""Which snapshots an autopsy replays: the earliest failure of each rank, and of each trigger kind.

A run can hold many snapshots: the recorder writes one per trigger edge (``nonfinite_loss``,
``overflow_streak``, ``scale_collapse``...) and per rank. Later snapshots of one rank usually
show the same fault again, or its damage, so replaying all of them costs time and says little.
The rule: the earliest failing snapshot of every rank (two ranks can fail for different
reasons), plus the earliest snapshot of every trigger kind not already picked (an
``overflow_streak`` may point at a backward overflow where the first ``nonfinite_loss`` points
at the forward). ``manual`` snapshots are the user's own checkpoints, not failures: never picked.
Neither are ``overflow_streak`` snapshots of GradScaler's start-up calibration (``calibrated_until``:
the last step of the leading skips, which older recorders counted as a streak).

The input is the report's snapshot list (``Report.frames.snapshots``: ``SnapshotInfo`` values
parsed from the file names, already restricted to ``--rank``), so the pick needs no torch and
opens no file.

Example:
    >>> from analyzer.load import SnapshotInfo
    >>> snaps = [SnapshotInfo("s/step00000031-r00000-overflow_streak.pt", 31, 0, "overflow_streak", 0),
    ...          SnapshotInfo("s/step00000024-r00000-nonfinite_loss.pt", 24, 0, "nonfinite_loss", 0)]
    >>> [(s.step, s.why) for s in pick_snapshots(snaps)]
    [(24, 'first failure of rank 0; first nonfinite_loss'), (31, 'first overflow_streak')]
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from recorders import schema

from ..load import SnapshotInfo

__all__ = ["is_failure", "pick_snapshots"]


def is_failure(info: SnapshotInfo) -> bool:
    """True for a snapshot a trigger (or a user's own named reason) wrote; False for ``manual``."""
    return info.step is not None and info.reason not in (None, schema.MANUAL)  # manual: Recorder.snapshot()'s default


def _order(info: SnapshotInfo) -> tuple:
    return (info.step, -1 if info.rank is None else info.rank, info.writer or 0, info.file)


def _calibration(info: SnapshotInfo, calibrated_until: int | None) -> bool:
    return calibrated_until is not None and info.reason == schema.OVERFLOW_STREAK and info.step <= calibrated_until


def pick_snapshots(snapshots: Iterable[SnapshotInfo], *, rank: int | None = None,
                   calibrated_until: int | None = None) -> list[SnapshotInfo]:
    """The snapshots worth replaying, earliest first (ties: lowest rank first).

    Args:
        snapshots: the snapshots as ``Report.frames.snapshots`` lists them.
        rank: only this rank's snapshots (``--rank``).
        calibrated_until: the last step of GradScaler's start-up calibration (the report's
            ``startup_calibration``), or None: ``overflow_streak`` snapshots up to it are not failures.

    Returns:
        The chosen snapshots, each with ``why``: ``"first failure of rank R"`` and/or
        ``"first REASON"``. Empty when no snapshot records a failure.
    """
    failing = sorted((s for s in snapshots if is_failure(s) and (rank is None or s.rank == rank)
                      and not _calibration(s, calibrated_until)), key=_order)
    picked: dict[str, SnapshotInfo] = {}
    seen_ranks: set = set()
    seen_reasons: set = set()
    for info in failing:
        why = []
        if info.rank not in seen_ranks:
            seen_ranks.add(info.rank)
            why.append(f"first failure of rank {info.rank}")
        if info.reason not in seen_reasons:
            seen_reasons.add(info.reason)
            why.append(f"first {info.reason}")
        if why:
            picked[info.file] = dataclasses.replace(info, why="; ".join(why))
    return sorted(picked.values(), key=_order)

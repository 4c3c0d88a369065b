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

The input is the report's snapshot list (``Report.frames.snapshots``: dicts with ``file``,
``step``, ``rank``, ``reason``, ``writer`` parsed from the file names, already restricted to
``--rank``), so the pick needs no torch and opens no file.

Example:
    >>> snaps = [{"file": "s/step00000031-r00000-overflow_streak.pt", "step": 31, "rank": 0,
    ...           "reason": "overflow_streak", "writer": 0},
    ...          {"file": "s/step00000024-r00000-nonfinite_loss.pt", "step": 24, "rank": 0,
    ...           "reason": "nonfinite_loss", "writer": 0}]
    >>> [s["step"] for s in pick_snapshots(snaps)]
    [24, 31]
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from recorders import schema

__all__ = ["MANUAL", "is_failure", "pick_snapshots"]

MANUAL = schema.MANUAL  # Recorder.snapshot()'s default reason, not a failure
OVERFLOW_STREAK = schema.OVERFLOW_STREAK


def is_failure(info: Mapping[str, Any]) -> bool:
    """True for a snapshot a trigger (or a user's own named reason) wrote; False for ``manual``."""
    return info.get("step") is not None and info.get("reason") not in (None, MANUAL)


def _order(info: Mapping[str, Any]) -> tuple:
    rank = info.get("rank")
    return (info["step"], -1 if rank is None else rank, info.get("writer") or 0, str(info.get("file")))


def _calibration(info: Mapping[str, Any], calibrated_until: int | None) -> bool:
    return (calibrated_until is not None and info.get("reason") == OVERFLOW_STREAK
            and info["step"] <= calibrated_until)


def pick_snapshots(snapshots: Iterable[Mapping[str, Any]], *, rank: int | None = None,
                   calibrated_until: int | None = None) -> list[dict[str, Any]]:
    """The snapshots worth replaying, earliest first (ties: lowest rank first).

    Args:
        snapshots: snapshot descriptions as ``Report.frames.snapshots`` lists them.
        rank: only this rank's snapshots (``--rank``).
        calibrated_until: the last step of GradScaler's start-up calibration (the report's
            ``startup_calibration``), or None: ``overflow_streak`` snapshots up to it are not failures.

    Returns:
        Copies of the chosen descriptions, each with ``why``: ``"first failure of rank R"`` and/or
        ``"first REASON"``. Empty when no snapshot records a failure.
    """
    failing = sorted((dict(s) for s in snapshots if is_failure(s) and (rank is None or s.get("rank") == rank)
                      and not _calibration(s, calibrated_until)), key=_order)
    picked: dict[str, dict[str, Any]] = {}
    seen_ranks: set = set()
    seen_reasons: set = set()
    for info in failing:
        why = []
        if info.get("rank") not in seen_ranks:
            seen_ranks.add(info.get("rank"))
            why.append(f"first failure of rank {info.get('rank')}")
        if info["reason"] not in seen_reasons:
            seen_reasons.add(info["reason"])
            why.append(f"first {info['reason']}")
        if why:
            picked[str(info["file"])] = {**info, "why": "; ".join(why)}
    return sorted(picked.values(), key=_order)

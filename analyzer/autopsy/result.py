"""``AutopsyResult``: what ``analyzer autopsy`` found (a plain value), and ``SnapshotFailure``.

``run_autopsy`` (``autopsy.py``) makes it; ``answer.py`` writes its answer lines from it; the
renderers read it. It lives apart from the code that produces it, so that neither imports the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..findings import json_safe

if TYPE_CHECKING:
    from ..load import SnapshotInfo
    from ..replay import Advice, Fix, ReplayResult
    from ..report import Report

__all__ = ["AUTOPSY_VERSION", "NO_SNAPSHOT", "AutopsyResult", "SnapshotFailure"]

AUTOPSY_VERSION = 1  # the --json object's "autopsy_version"; bump only when a field changes meaning
NO_SNAPSHOT = "no_snapshot"  # the verdict when the report has errors but there is no replay


@dataclass(frozen=True)
class SnapshotFailure:
    """A picked snapshot whose replay (or fixes) could not run: its file and the one-line error."""

    snapshot: str
    stage: str  # "replay", "fixes" or "window" (its rewind window, Recorder(rewind=K))
    error: str

    def to_dict(self) -> dict[str, str]:
        return {"snapshot": self.snapshot, "stage": self.stage, "error": self.error}


@dataclass(frozen=True)
class AutopsyResult:
    """What ``run_autopsy`` found.

    Attributes:
        run: the run as given.
        report: the ``Report`` (``analyzer report``'s object); None for a checkpoint and a batch
            without a training log of their own.
        picked: the snapshots picked, earliest first, each with ``why``.
        replays: the ``ReplayResult`` of each picked snapshot that replayed: the primary first,
            then the others in ``picked`` order.
        fixes: ``(snapshot, Fix)`` for every fix tried or considered, per distinct culprit.
        advice: ``(snapshot, Advice)``: advice lines with their status (``verified``/``untested``).
        shared: ``(snapshot, other)``: this snapshot's culprit is ``other``'s, whose fixes apply.
        failures: picked snapshots that could not be replayed or fixed.
        lines: the answer's lines (``answer()``), written from the fields above when the result is made.
        windows: for each replayed snapshot with a rewind window, its replay over the K steps recorded
            (``replay --steps K``'s ``WindowResult``).
    """

    run: str
    report: Report | None  # None: a checkpoint replayed with no training log of its own
    picked: tuple[SnapshotInfo, ...] = ()
    replays: tuple[ReplayResult, ...] = ()
    fixes: tuple[tuple[str, Fix], ...] = ()
    advice: tuple[tuple[str, Advice], ...] = ()
    shared: tuple[tuple[str, str], ...] = ()
    failures: tuple[SnapshotFailure, ...] = ()
    lines: tuple[str, ...] = ()  # the answer (``answer.answer_lines``), built once by ``run_autopsy``
    windows: tuple[Any, ...] = ()  # the rewind windows of snapshots recorded with Recorder(rewind=K) (WindowResult)

    @property
    def primary(self) -> ReplayResult | None:
        """The replay the answer is about (``replays[0]``, see ``run_autopsy``), or None."""
        return self.replays[0] if self.replays else None

    @property
    def verdict(self) -> str:
        """The primary replay's verdict; without one, ``healthy`` (no error finding) or ``no_snapshot``."""
        if self.primary is not None:
            return self.primary.verdict
        return NO_SNAPSHOT if self.report is not None and self.report.errors else "healthy"

    @property
    def culprit(self) -> Any:
        """The primary replay's ``Culprit`` (a read-only mapping), or None."""
        return self.primary.culprit if self.primary is not None else None

    def answer(self) -> list[str]:
        """The answer, a few plain lines: root cause, where, verified fixes, untested advice."""
        return list(self.lines)

    def exit_status(self, fail_on: str | None = None) -> int:
        """1 when a picked snapshot failed to replay, else the report's status (3 check_failed, 4 --fail-on)."""
        if self.failures:
            return 1
        return self.report.exit_status(fail_on) if self.report is not None else 0

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` object: ``report`` and each of ``replays`` exactly as their own commands print them."""
        culprit = self.culprit
        if culprit is not None:  # a replay ran, so analyzer.replay (and torch) is loaded already
            from ..replay.result.records import headline

            culprit = headline(culprit)  # the op the answer leads with: replay --json's culprit
        return json_safe({
            "autopsy_version": AUTOPSY_VERSION,
            "run": self.run,
            "verdict": self.verdict,
            "culprit": culprit.to_dict() if culprit is not None else None,
            "answer": self.answer(),
            "report": self.report.to_dict() if self.report is not None else None,
            "replays": [r.to_dict() for r in self.replays],
            "fixes": [{"snapshot": s, **f.to_dict()} for s, f in self.fixes],
            "advice": [{"snapshot": s, **a.to_dict()} for s, a in self.advice],
            "picked": [p.to_dict() for p in self.picked],
            "shared_fixes": [{"snapshot": s, "same_culprit_as": o} for s, o in self.shared],
            "errors": [f.to_dict() for f in self.failures],
            **({"windows": [w.to_dict() for w in self.windows]} if self.windows else {}),  # replay --steps K's
        })

"""``analyzer autopsy RUN``: report, pick the snapshots, replay them, try the fixes; one answer.

Without it a user runs ``analyzer report``, reads which snapshot to pick, runs ``analyzer replay``
on it and then has to trust advice nobody has tried. ``run_autopsy`` chains the four
stages and returns one frozen ``AutopsyResult`` (``result.py``):

1. the report, exactly as ``analyzer report`` builds it (``build_report``);
2. the snapshots worth replaying (``pick_snapshots``: the earliest failure of each rank, and
   the earliest of each trigger kind, never GradScaler's start-up calibration), usually one; the
   answer leads with the one the report's first error finding points at (``_primary_first``);
3. the replay of each (``replay_snapshot``, the precisions ``analyzer replay`` uses by default);
4. the counterfactual fixes tried on each replay's culprit (``analyzer.replay.fixes.registry``). Two
   snapshots that blame the same op in the same module and phase share one set of fixes: trying
   them again costs one replay per fix and cannot say anything new.

A snapshot that cannot be replayed (its model code is not importable, the file is damaged) is
kept as a ``SnapshotFailure`` next to the report instead of losing the report; the CLI prints
both and exits 1.

Example:
    >>> a = run_autopsy("amp-autopsy-demo/fp16_attention_overflow")  # doctest: +SKIP
    >>> a.verdict, a.culprit["op"], a.culprit["module"]              # doctest: +SKIP
    ('overflow', 'aten.bmm', 'blocks.0.attn')
    >>> [f.status for _, f in a.fixes]                                # doctest: +SKIP
    ['verified', 'verified', 'verified', ...]
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import AnalyzerError
from .answer import answer_lines
from .pick import pick_snapshots
from .result import AutopsyResult, SnapshotFailure

if TYPE_CHECKING:
    from ..replay import ReplayResult
    from ..report import Report

__all__ = ["run_autopsy"]


def _culprit_key(result: ReplayResult) -> tuple | None:
    c = result.culprit
    if c is None:
        return None
    return (result.verdict, c.op, c.module, c.phase, c.precision)


def _first_error(report: Report | None) -> Any:
    """The report's first error finding in time (a trace failure, not a check that crashed), or None."""
    from ..report.checks import CHECK_FAILED

    if report is None:  # a checkpoint with no training log of its own
        return None
    errors = [f for f in report.errors if f.check != CHECK_FAILED and f.step is not None]
    return min(errors, key=lambda f: (f.step, f.rank or 0), default=None)


def _primary_first(replays: list, report: Report | None, ranks: dict[str, Any]) -> tuple:
    """The replay of the failure that killed the run first, the others after in order.

    The primary is the earliest replay that is not healthy of a snapshot the report's first error
    finding points at: the first at or after that finding's step (and of its rank, when it names one).
    So the first non-finite loss, non-finite gradients or broken weights head the answer, and an
    earlier loss-scale overflow heads it only when the report's first error is that overflow
    (``scale_collapse``, ``frequent_overflow``). Without such a replay: the earliest that is not healthy.

    A failure the replay did not reproduce (``not_reproduced``) comes after every reproduced one.
    NB: a rank that snapshots only because a peer failed (``peer_failure``) replays healthy; the
    rank that holds the fault is the answer even when the healthy one has the lower rank. When
    every replay is healthy, the earliest comes first.
    """
    # a failure the replay reproduced first, then one it did not (not_reproduced: no op to show)
    failing = ([r for r in replays if r.verdict not in ("healthy", "not_reproduced")]
               + [r for r in replays if r.verdict == "not_reproduced"])
    first_error = _first_error(report)
    pointed = [] if first_error is None else [
        r for r in failing if r.step is not None and r.step >= first_error.step
        and (first_error.rank is None or ranks.get(r.snapshot) in (None, first_error.rank))]
    first = next(iter(pointed or failing), replays[0] if replays else None)
    return tuple([first] + [r for r in replays if r is not first]) if first is not None else ()


def _checkpoint_report(snap, progress: bool):
    """The report of a checkpoint's own training log (``logs``: an HF trainer_state.json), or None; the pick."""
    from ..report import build_report

    report = build_report(snap.logs, progress=progress) if getattr(snap, "logs", None) else None
    from ..load import SnapshotInfo

    picked = [SnapshotInfo(str(snap.path), step=snap.step, rank=0, reason=snap.reason, writer=0,
                           why="the checkpoint and batch given")]
    return report, picked


def _window(replay, snap: str, say: Callable[[str], object], failures: list):
    """A snapshot's rewind window replayed over the K steps it was recorded with (``replay --steps K``), or None."""
    from ..replay.window import replay_window

    rw = getattr(replay.snapshot, "rewind", None)
    if rw is None:
        return None
    say(f"replaying the {rw['steps_asked']} steps before {snap} in FP32 and the run's precision")
    try:
        return replay_window(replay, rw["steps_asked"])
    except (AnalyzerError, OSError, MemoryError) as e:
        failures.append(SnapshotFailure(snap, "window", " ".join(str(e).split())))
        return None


def run_autopsy(run, *, rank: int | None = None, device: str = "auto", factory: str | None = None,
                loss_fn: str | None = None, paths: tuple[str, ...] = (), progress: bool = False,
                on_stage: Callable[[str], object] | None = None,
                factory_kwargs: dict | None = None) -> AutopsyResult:
    """Report, pick, replay and try fixes on `run`.

    Args:
        run: a run directory (or its ``meta.json``); a foreign log gives a report-only answer; a
            ``Snapshot`` of a checkpoint and a batch (``load.adhoc``) is replayed, and its own log
            (``logs``), when it has one, is the report (``report`` is None otherwise).
        rank: only this rank (the report's ``--rank``, and the snapshots picked).
        device: where to replay: ``auto``, ``cpu`` or ``cuda``.
        factory, loss_fn: override the snapshots' model factory / loss references.
        factory_kwargs: merged over each picked snapshot's own (``--factory-kwargs``,
            ``load.overrides.with_factory_kwargs``); a checkpoint's are applied when it is opened.
        paths: extra import roots for the snapshots' factory and loss (``--path``).
        progress: progress bars on stderr.
        on_stage: called with one line per stage started (the demo prints them).

    Raises:
        BadInputError, VersionError: the run itself cannot be read (a snapshot that cannot be
        replayed is a ``SnapshotFailure`` instead).
    """
    from ..replay import Replay, advice_with_status
    from ..report import build_report
    from ..report.checks.scaler import calibration_end

    from ..load import Snapshot, load_snapshot
    from ..load.overrides import with_factory_kwargs

    say = on_stage or (lambda _line: None)
    if isinstance(run, Snapshot):  # a checkpoint and a batch (load.adhoc): its own logs, if any, are the report
        report, picked = _checkpoint_report(run, progress)
    else:
        report = build_report(run, rank=rank, progress=progress)
        calibration = calibration_end(report.frames)
        picked = pick_snapshots(report.frames.snapshots, rank=rank,
                                calibrated_until=None if calibration is None else calibration["last_step"])
    replays: list = []
    fixes: list = []
    advice: list = []
    shared: list = []
    failures: list = []
    windows: list = []
    fixed: dict[tuple, str] = {}
    for info in picked:
        snap = info.file
        say(f"replaying {snap} ({info.why})")
        try:
            target = run if isinstance(run, Snapshot) else snap
            if factory_kwargs is not None and not isinstance(run, Snapshot):
                target = with_factory_kwargs(load_snapshot(snap), factory_kwargs)
            replay = Replay(target, device=device, factory=factory, loss_fn=loss_fn, progress=progress, paths=paths)
            result = replay.run()
        except (AnalyzerError, OSError, MemoryError) as e:
            failures.append(SnapshotFailure(snap, "replay", " ".join(str(e).split())))
            continue
        replays.append(result)
        window = _window(replay, snap, say, failures)  # Recorder(rewind=K): the K steps before it
        if window is not None:
            windows.append(window)
        key = _culprit_key(result)
        if key is not None and key in fixed:
            shared.append((snap, fixed[key]))
            continue
        if key is not None:
            say(f"trying fixes on {result.culprit.op} in {result.culprit.module}")
        try:
            tried = replay.try_fixes(result)
        except (AnalyzerError, OSError, MemoryError) as e:
            failures.append(SnapshotFailure(snap, "fixes", " ".join(str(e).split())))
            continue
        if key is not None:
            fixed[key] = snap
        fixes += [(snap, f) for f in tried]
        advice += [(snap, a) for a in advice_with_status(result, tried)]
    ranks = {p.file: p.rank for p in picked}
    result = AutopsyResult(run=run.path if isinstance(run, Snapshot) else str(run), report=report,
                           picked=tuple(picked), replays=_primary_first(replays, report, ranks),
                           fixes=tuple(fixes), advice=tuple(advice), shared=tuple(shared),
                           failures=tuple(failures), windows=tuple(windows))
    return dataclasses.replace(result, lines=tuple(answer_lines(result)))

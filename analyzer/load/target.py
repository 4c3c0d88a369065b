"""What the user named on the command line, opened: a snapshot, a run, or a checkpoint and its batch.

``analyzer replay PATH`` and ``analyzer autopsy PATH`` take a path and, for a checkpoint written without
the recorder, ``--batch FILE``. ``open_target`` decides what the path is and returns a ``Target``: what
the replay or the autopsy reads (the path of a snapshot or a run, or the checkpoint and its batch opened
as the ``Snapshot`` replay consumes) and the directory that holds the run's files. The command line
only parses its options, calls it, and renders.

Example:
    >>> open_target("runs/exp1", command="autopsy").run_dir  # doctest: +SKIP
    PosixPath('runs/exp1')
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .snapshot import Snapshot

__all__ = ["Target", "open_target"]

Kind = Literal["snapshot", "run", "checkpoint"]


@dataclass(frozen=True)
class Target:
    """A path the user named, opened.

    `kind`: ``snapshot`` (replay's recorder snapshot, read by the replay itself), ``run`` (autopsy's run
    directory, its ``meta.json`` or a foreign log), ``checkpoint`` (a checkpoint with ``--batch``).
    `source`: what ``replay_snapshot`` / ``run_autopsy`` read: the path, or for a checkpoint the
    ``Snapshot`` made of it and its batch. `run_dir`: the directory of the run's files (a file's
    directory for a file), beside which the autopsy's outputs link.
    """

    named: str
    kind: Kind
    source: str | Snapshot
    run_dir: Path


def open_target(path: str | os.PathLike, *, command: Literal["replay", "autopsy"], batch: str | None = None,
                amp: str | None = None, scale: float | None = None, accumulate: str | None = None,
                factory: str | None = None, loss_fn: str | None = None, device: str = "auto",
                paths: tuple[str, ...] = (), rng: str | None = None, factory_kwargs: dict | None = None,
                rank: int | None = None) -> Target:
    """Open `path` for `command`: with `batch`, the checkpoint and batch as a ``Snapshot``
    (``adhoc.load_checkpoint_snapshot``, with `amp`, `scale`, `accumulate`, `factory`, `loss_fn`, `device`
    and `paths`); without, the path itself, a snapshot for replay (a checkpoint is refused, naming
    ``--batch``) or a run for the autopsy. `rng` (``--rng``) is the checkpoint's RNG file; `factory_kwargs`
    (``--factory-kwargs``, parsed) are merged over the snapshot's own (``overrides.with_factory_kwargs``), so
    a snapshot is then loaded here, `rank`'s sibling when given (``--rank``).

    Raises:
        BadInputError: a checkpoint given to replay without `batch`, or an unreadable checkpoint or batch;
            FactoryError: a checkpoint that names no model or loss.
    """
    named = os.fspath(path)
    p = Path(named)
    run_dir = p.parent if p.is_file() else p  # a meta.json, a foreign log, a file checkpoint
    if batch is not None:
        from .adhoc import load_checkpoint_snapshot

        snap = load_checkpoint_snapshot(named, batch, factory=factory, loss_fn=loss_fn, amp=amp, scale=scale,
                                        device=device, paths=paths, accumulate=accumulate or "auto", rng=rng)
        if factory_kwargs is not None:
            from .overrides import with_factory_kwargs

            snap = with_factory_kwargs(snap, factory_kwargs)
        return Target(named, "checkpoint", snap, run_dir)
    if command == "replay":
        from .adhoc import checkpoint_instead

        err = checkpoint_instead(named)
        if err is not None:
            raise err
        if factory_kwargs is not None:  # applied to the loaded snapshot: replay takes it as it takes a file's
            from .dcp import sibling_snapshot
            from .overrides import with_factory_kwargs
            from .snapshot import load_snapshot

            snap = load_snapshot(sibling_snapshot(named, rank) if rank is not None else named)
            return Target(named, "snapshot", with_factory_kwargs(snap, factory_kwargs), run_dir)
        return Target(named, "snapshot", named, run_dir)
    return Target(named, "run", named, run_dir)

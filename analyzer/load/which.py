"""The right command for a path given to the wrong one: a run directory to replay, a snapshot to report.

Each function returns the one-line ``BadInputError`` that names the command (and the file) that
reads the path. Nothing here opens a torch file: only names, directory listings and a file's
first bytes are read.
"""
from __future__ import annotations

import shlex
from pathlib import Path

from recorders import schema

from ..errors import BadInputError

__all__ = ["directory_given_to_replay", "torch_file_given_to_report"]

def _q(path: Path | str) -> str:
    return shlex.quote(str(path))


def _first_failing_snapshot(run_dir: Path) -> Path | None:
    """The earliest snapshot a trigger wrote (lowest step, then rank and writer), from file names only."""
    found = []
    try:
        names = [e.name for e in (run_dir / schema.SNAPSHOT_DIR).iterdir()]
    except OSError:
        return None
    for name in names:
        m = schema.SNAPSHOT_RE.match(name)
        if m and not name.startswith(".") and m[4] != schema.MANUAL:  # the user's own checkpoints, not failures
            found.append((int(m[1]), int(m[2]), int(m[3] or 0), name))
    return run_dir / schema.SNAPSHOT_DIR / min(found)[3] if found else None


def directory_given_to_replay(path: Path) -> BadInputError:
    """``analyzer replay DIR``: replay takes one snapshot file; name the run's first failing one."""
    if (path / schema.META_FILE).is_file():
        first = _first_failing_snapshot(path)
        if first is not None:
            return BadInputError(
                f"is a run directory; replay takes one snapshot file, and this run's first failing snapshot is "
                f"{first}", path=path,
                fix=f"analyzer replay {_q(first)}; for the whole answer (report, replays, fixes): analyzer autopsy "
                    f"{_q(path)}")
        return BadInputError("is a run directory with no failing snapshot to replay", path=path,
                             fix=f"analyzer autopsy {_q(path)} (or analyzer report {_q(path)}) reads the whole run")
    if path.name == schema.SNAPSHOT_DIR and (path.parent / schema.META_FILE).is_file():
        first = _first_failing_snapshot(path.parent)
        pick = f"analyzer replay {_q(first)}; " if first is not None else ""
        return BadInputError("is a run's snapshots directory; replay takes one snapshot file", path=path,
                             fix=f"{pick}analyzer autopsy {_q(path.parent)} picks and replays them")
    return BadInputError("is a directory; replay takes one snapshot file (RUN_DIR/snapshots/*.pt)", path=path,
                         fix="pass a .pt file written by the recorder, or run analyzer autopsy RUN_DIR")


def torch_file_given_to_report(path: Path) -> BadInputError | None:
    """``analyzer report FILE`` / ``autopsy FILE`` on a snapshot or another torch file; None for other files."""
    is_snapshot = schema.SNAPSHOT_RE.match(path.name) is not None
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return None
    is_torch = head == b"PK\x03\x04" or (head[:1] == b"\x80" and path.suffix in (".pt", ".pth", ".bin", ".ckpt"))
    if not (is_snapshot or is_torch):
        return None
    if is_snapshot:
        run_dir = path.parent.parent if path.parent.name == schema.SNAPSHOT_DIR else None
        run = (f"; report and autopsy read its run directory: analyzer autopsy {_q(run_dir)}"
               if run_dir is not None and (run_dir / schema.META_FILE).is_file() else "")
        return BadInputError("is a snapshot of one failing step, not a run", path=path,
                             fix=f"analyzer replay {_q(path)}{run}")
    return BadInputError("is a torch file, not a run directory or a training log", path=path,
                         fix=f"analyzer replay {_q(path)} for a recorder snapshot, analyzer inspect {_q(path)} for "
                             "a checkpoint")

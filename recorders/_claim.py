"""Which writer of a rank this process is: claiming ``meta.json`` (or ``meta-rR[-wN].json``) exclusively.

Every process of a multi-GPU launch without ``torch.distributed`` believes it is rank 0. The
first to create the rank's meta file is writer 0 and keeps the version-1 file names; another
process finds the name taken by a live process and takes the next writer number, so both keep
every row and the reader can tell them apart. A meta file left by a process that is gone
(same host, pid no longer running; or this process, from a closed Recorder) is taken over:
that is a resumed run, and it continues the same writer's part numbers.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from . import schema
from ._io import atomic_write, write_new

__all__ = ["claim_writer", "release_writer"]

_MAX_WRITERS = 1024
# (run directory, rank, writer) claimed by a live Recorder of this process.
_ACTIVE: set[tuple[str, int, int]] = set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: an existence check, nothing is sent
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, under another user
        return True
    return True


def _holder(path: Path) -> dict:
    """pid and host recorded in an existing meta file ({} if unreadable: treated as live)."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _stale(holder: dict, key: tuple[str, int, int]) -> bool:
    """True when the file's writer is known to be gone: same host, and not running (or us, closed)."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool):
        return False
    if pid == os.getpid():
        return key not in _ACTIVE
    return not _alive(pid)


def claim_writer(run_dir: Path, rank: int, meta: bytes) -> tuple[int, list[dict]]:
    """Write `meta` under the first free (or stale) writer slot of `rank`.

    Returns:
        (writer number, the pid/host dicts of the live writers found before it).
    """
    root = os.path.realpath(run_dir)
    others: list[dict] = []
    for writer in range(_MAX_WRITERS):
        key = (root, rank, writer)
        path = Path(run_dir) / schema.meta_name(rank, writer)
        if key not in _ACTIVE:
            if write_new(path, lambda f: f.write(meta)):
                _ACTIVE.add(key)
                return writer, others
            holder = _holder(path)
            if _stale(holder, key):
                atomic_write(path, lambda f: f.write(meta))
                _ACTIVE.add(key)
                return writer, others
        else:
            holder = _holder(path)
        others.append({"pid": holder.get("pid"), "host": holder.get("host")})
    raise FileExistsError(f"{_MAX_WRITERS} writers already claim rank {rank} in {run_dir}")


def release_writer(run_dir: Path, rank: int, writer: int) -> None:
    """Forget this process's claim (on close): a later Recorder here may resume the slot."""
    _ACTIVE.discard((os.path.realpath(run_dir), rank, writer))

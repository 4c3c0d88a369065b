"""Atomic file writes: a hidden temporary file in the same directory, fsync, then rename or claim.

``atomic_write`` replaces the destination (for files a process owns). ``claim_write`` never
replaces anything: it links the finished temporary file to the first free name of a numbered
series, so two processes writing one directory cannot destroy each other's files.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write", "claim_write", "write_new"]

_MAX_CLAIMS = 100_000  # a bound on the free-name search, far above any real run's part count


def _tmp_for(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _fill(tmp: Path, write: Callable[[BinaryIO], object]) -> None:
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    """Make a rename or link in `directory` durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Write `path` atomically: `write(f)` fills a hidden temporary file that is then renamed.

    A reader (or a ``kill -9``) never sees a partial file under the final name. Temporary
    files start with ``.`` and end in ``.tmp`` so readers skip them. An existing `path` is
    replaced: use ``claim_write`` where another process may own the name.

    Example:
        >>> atomic_write("/tmp/x.bin", lambda f: f.write(b"hello"))  # doctest: +SKIP
    """
    path = Path(path)
    tmp = _tmp_for(path)
    try:
        _fill(tmp, write)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def _link_exclusive(tmp: Path, path: Path) -> bool:
    """Give `tmp`'s finished content the name `path` unless it exists. True when claimed.

    A hard link fails with EEXIST instead of overwriting. Where the filesystem has no hard
    links, an ``O_EXCL`` placeholder claims the name and a rename fills it (a reader may then
    briefly see an empty file under the final name).
    """
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS):
            raise
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    os.replace(tmp, path)
    return True


def claim_write(name_for: Callable[[int], str | os.PathLike], start: int,
                write: Callable[[BinaryIO], object]) -> tuple[Path, int]:
    """Write the first free name of a series atomically; never replace an existing file.

    Args:
        name_for: index -> path; all paths in one directory.
        start: the first index to try.
        write: fills the file.

    Returns:
        (the path written, its index). The content is written once, to a temporary file;
        each taken name costs one failed ``link``.

    Example:
        >>> claim_write(lambda i: f"/tmp/part{i}", 0, lambda f: f.write(b"x"))  # doctest: +SKIP
        (PosixPath('/tmp/part0'), 0)
    """
    first = Path(name_for(start))
    tmp = _tmp_for(first)
    try:
        _fill(tmp, write)
        for index in range(start, start + _MAX_CLAIMS):
            path = Path(name_for(index))
            if _link_exclusive(tmp, path):
                break
        else:
            raise FileExistsError(f"no free name among {_MAX_CLAIMS} after {first}")
    finally:
        _unlink(tmp)
    _fsync_dir(path.parent)
    return path, index


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def write_new(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> bool:
    """Write `path` atomically only if no file has that name; False (nothing written) if one has."""
    path = Path(path)
    tmp = _tmp_for(path)
    try:
        _fill(tmp, write)
        claimed = _link_exclusive(tmp, path)
    finally:
        _unlink(tmp)
    if claimed:
        _fsync_dir(path.parent)
    return claimed

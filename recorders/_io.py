"""Atomic file writes: temporary name in the same directory, fsync, rename, fsync the directory."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write"]


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Write `path` atomically: `write(f)` fills a hidden temporary file that is then renamed.

    A reader (or a ``kill -9``) never sees a partial file under the final name. Temporary
    files start with ``.`` and end in ``.tmp`` so readers skip them.

    Example:
        >>> atomic_write("/tmp/x.bin", lambda f: f.write(b"hello"))  # doctest: +SKIP
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return path

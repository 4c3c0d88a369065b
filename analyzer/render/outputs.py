"""Where the analyzer may write: never onto an input, always atomically.

``report --html``/``--plots`` and ``replay --plot`` write files the user names. A slip such as
``--html runs/x/meta.json`` must not overwrite the run's own metadata and leave it unreadable. The
rule, in one place: an output path may not be an input file, nor one of a run directory's recorded
files (``meta.json``, ``meta-r*.json``, anything under ``trace/`` or ``snapshots/``), nor a log an
importer reads in that directory (``trainer_state.json``, ``metrics.csv``, TensorBoard events).
Other files, including an earlier report, may be replaced, and are replaced atomically: a
temporary file in the same directory, then a rename, so a crash leaves the old file or the new one.

Example:
    >>> check_output_path("runs/x/report.html", inputs=["runs/x"], option="--html")  # doctest: +SKIP
    >>> atomic_write_bytes("runs/x/report.html", b"<!doctype html>...")                # doctest: +SKIP
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from recorders import schema

from ..errors import BadInputError
from ..load import IMPORTED_LOGS, TFEVENTS_PREFIX

__all__ = ["check_output_path", "atomic_write_bytes", "atomic_write_text"]


def _same(a: Path, b: Path) -> bool:
    try:
        return a == b or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _recorded_in(out: Path, run_dir: Path) -> str | None:
    """Why `out` is one of the run directory's own files, or None."""
    try:
        rel = out.relative_to(run_dir)
    except ValueError:
        return None
    parts = rel.parts
    if not parts:
        return "it is the run directory itself"
    if parts[0] in (schema.TRACE_DIR, schema.SNAPSHOT_DIR):
        return f"it is inside the run's {parts[0]}/ directory"
    name = parts[-1]
    if len(parts) == 1 and (name == schema.META_FILE or (name.startswith("meta-r") and name.endswith(".json"))):
        return "it is one of the run's meta files"
    if name in IMPORTED_LOGS or name.startswith(TFEVENTS_PREFIX):
        return "it is a training log the run is read from"
    return None


def check_output_path(out: str | os.PathLike, *, inputs: list[str | os.PathLike], option: str,
                      is_dir: bool = False) -> Path:
    """Refuse an output path that would land on an input; return it resolved.

    Args:
        out: the path the user asked to write (a file, or a directory for ``--plots``).
        inputs: the files and run directories the command reads.
        option: the option that named `out`, for the message.
        is_dir: `out` is a directory the command writes files into.
    Raises:
        BadInputError: naming `out`, why, and the fix.
    """
    target = Path(out).expanduser().resolve()
    for raw in inputs:
        src = Path(raw).expanduser().resolve()
        reason = None
        if _same(target, src) and not is_dir:
            reason = "it is the input file"
        elif src.is_dir():
            if is_dir and target == src:
                reason = None  # plots written next to meta.json carry their own names
            else:
                reason = _recorded_in(target, src)
        if reason:
            raise BadInputError(f"refusing to write {option} here: {reason}, and inputs are never overwritten",
                                path=out, fix=f"pass {option} a path outside the run's recorded files")
    return target


def _umask() -> int:
    """The process umask (read by setting it and putting it back at once: there is no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` through a temporary file in the same directory and a rename."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            # mkstemp makes the file 0600; a page or plot to share gets the mode open() would give it
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return out


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """``atomic_write_bytes`` for UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))

"""Read a torch file safely: weights_only, a zip-bomb bound and a nesting bound, one-line errors.

Every reader of a ``.pt`` file (snapshots, checkpoints) goes through ``torch_load_safe``.
"""
from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInputError
from ._limits import ARCHIVE_RATIO_ENV, archive_budget, check_nesting, max_archive_ratio

__all__ = ["torch_load_safe"]


def torch_load_safe(path: str | os.PathLike, *, mmap: bool = False, max_ratio: float | None = None) -> Any:
    """``torch.load(weights_only=True)`` with every failure mapped to a one-line BadInputError.

    Loading never executes code from the file: weights_only refuses pickled classes. Memory is
    bounded before anything is allocated: a zip archive may not declare more uncompressed bytes
    than ``_limits.archive_budget`` allows for its size (torch itself checks each storage record
    against the size the pickle declares), and nesting deeper than ``_limits.MAX_NESTING`` is
    refused. Warnings torch emits while reading are held back: dropped when the file is refused,
    re-issued after a successful load.

    `max_ratio` bounds this read's archive (declared bytes per byte of file); None: the ratio in
    force (``archive_ratio_limit``, ``AMP_AUTOPSY_MAX_ARCHIVE_RATIO``, else the default).
    """
    if max_ratio is not None and not max_ratio > 0:
        raise ValueError(f"max_ratio must be positive, got {max_ratio!r}")
    path = Path(path)
    if not path.exists():
        raise BadInputError("no such file", path=path, fix="check the path")
    if path.is_dir():
        raise BadInputError("is a directory, expected a file", path=path)
    _check_archive(path, max_archive_ratio() if max_ratio is None else max_ratio)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obj = _torch_load(path, mmap)
    check_nesting(obj, path=path, what="the file's content")
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return obj


def _check_archive(path: Path, ratio: float) -> None:
    """Refuse a zip whose declared uncompressed sizes exceed the file by more than the limit."""
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as zf:
            declared = sum(max(0, i.file_size) for i in zf.infolist())
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
        return  # not a zip (or a broken one): torch.load reports it
    if declared > archive_budget(size, ratio):
        raise BadInputError(
            f"refused: the archive declares {declared} bytes uncompressed in a {size}-byte file "
            f"(more than {ratio:g}x; torch.save files are stored uncompressed), "
            "so it looks like a zip bomb",
            path=path, fix=f"if you trust the file, raise the limit with 'analyzer --max-archive-ratio N' "
            f"or {ARCHIVE_RATIO_ENV}=N")


def _torch_load(path: Path, mmap: bool) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        glob = re.search(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.]+)", str(e))
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if glob:
            first = f"unsupported global {glob.group(1)}"
            raise BadInputError(
                "refused: the file holds pickled Python objects that would need code execution "
                f"to load ({first[:160]})",
                path=path,
                fix="save plain state_dicts (tensors and primitives) instead of modules or "
                "custom classes; amp-autopsy never loads with weights_only=False",
            ) from e
        raise _unreadable(path) from e  # torch's own words: --debug
    except Exception as e:  # noqa: BLE001 - garbage makes the unpickler raise anything (KeyError, IndexError...)
        raise _unreadable(path) from e


def _unreadable(path: Path) -> BadInputError:
    words = plain_words(path)
    fix = "the file was cut short: copy it again" if words.startswith("truncated") else _FIX
    return BadInputError(words, path=path, fix=fix)


_FIX = "pass a file written by torch.save or the amp-autopsy recorder"


def plain_words(path: Path) -> str:
    """What is wrong with a file torch cannot read, from its first and last bytes, in plain words.

    Torch's own message (pickle opcodes, miniz errors) is kept in the exception chain, which
    ``analyzer --debug`` prints.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        return f"cannot be read ({type(e).__name__}: {e})"
    if size == 0:
        return "empty file (0 bytes): not a torch file"
    if head.startswith(b"PK\x03\x04"):
        if not zipfile.is_zipfile(path):
            return "truncated: the archive ends before its index"
        return ("not a readable torch file: a complete zip archive whose torch records are corrupt or foreign "
                "(analyzer --debug shows torch's message)")
    if head[:1] == b"\x80":
        return ("not a readable torch file: a pickle stream (a legacy torch file) that is truncated or corrupt "
                "(analyzer --debug shows torch's message)")
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < size:
        return "a .safetensors file, not a torch file (analyzer inspect reads it)"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and all(c.isprintable() or c in "\t\r\n" for c in text):
        start = " ".join(text.split())[:40]
        return f"not a torch file (it starts with text: {start!r})"
    return f"not a torch file (it starts with bytes {head[:8].hex(' ')})"

"""Load snapshots and resolve factory / loss_fn references, with version and safety checks.

Run directories and foreign logs are read by ``analyzer.runs``; checkpoints by ``analyzer.inspect``.
"""
from __future__ import annotations

import importlib
import os
import pickle
import re
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from recorders import schema

from ._limits import ARCHIVE_RATIO_ENV, archive_budget, max_archive_ratio
from ._validate import check_nesting, validate_snapshot
from ._versions import check_format_version
from .errors import BadInputError, FactoryError

__all__ = ["load_snapshot", "resolve_ref", "torch_load_safe"]


def torch_load_safe(path: str | os.PathLike, *, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` with every failure mapped to a one-line BadInputError.

    Loading never executes code from the file: weights_only refuses pickled classes. Memory is
    bounded before anything is allocated: a zip archive may not declare more uncompressed bytes
    than ``_limits.archive_budget`` allows for its size (torch itself checks each storage record
    against the size the pickle declares), and nesting deeper than ``_limits.MAX_NESTING`` is
    refused. Warnings torch emits while reading are held back: dropped when the file is refused,
    re-issued after a successful load.
    """
    path = Path(path)
    if not path.exists():
        raise BadInputError("no such file", path=path, fix="check the path")
    if path.is_dir():
        raise BadInputError("is a directory, expected a file", path=path)
    _check_archive(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obj = _torch_load(path, mmap)
    check_nesting(obj, path=path, what="the file's content")
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return obj


def _check_archive(path: Path) -> None:
    """Refuse a zip whose declared uncompressed sizes exceed the file by more than the limit."""
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as zf:
            declared = sum(max(0, i.file_size) for i in zf.infolist())
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
        return  # not a zip (or a broken one): torch.load reports it
    if declared > archive_budget(size):
        raise BadInputError(
            f"refused: the archive declares {declared} bytes uncompressed in a {size}-byte file "
            f"(more than {max_archive_ratio():g}x; torch.save files are stored uncompressed), "
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
        detail = re.search(r"WeightsUnpickler error:\s*(.+)", str(e))
        raise BadInputError(
            "not a readable torch file: truncated, corrupt or foreign "
            f"({detail.group(1).strip()[:160] if detail else first[:160]})",
            path=path,
            fix="pass a file written by torch.save or the amp-autopsy recorder",
        ) from e
    except Exception as e:  # noqa: BLE001 - garbage makes the unpickler raise anything (KeyError, IndexError...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BadInputError(
            f"not a readable torch file: truncated, corrupt or foreign ({first[:160]})",
            path=path,
            fix="pass a file written by torch.save or the amp-autopsy recorder",
        ) from e


def load_snapshot(path: str | os.PathLike) -> dict[str, Any]:
    """Load and validate a recorder snapshot. Raises BadInputError / VersionError."""
    snap = torch_load_safe(path)
    if not isinstance(snap, dict) or snap.get("format") != schema.SNAPSHOT_FORMAT:
        raise BadInputError(
            "not an amp-autopsy snapshot (no 'format': 'amp-autopsy.snapshot' key)",
            path=path,
            fix="pass a .pt file from RUN_DIR/snapshots/; for checkpoints use 'analyzer inspect'",
        )
    check_format_version(snap, path=path, what="snapshot")
    # keys added after version 1 (schema.KEYS_ADDED, e.g. cwd) are optional: older snapshots lack them
    missing = [k for k in schema.SNAPSHOT_KEYS if k not in snap and k not in schema.KEYS_ADDED]
    if missing:
        raise BadInputError(f"snapshot lacks keys {missing}", path=path, fix="re-record the run")
    validate_snapshot(snap, path)
    return snap


_REFUSED_ROOTS = set(sys.stdlib_module_names) | {"builtins", "__main__", "torch", "os", "subprocess"}


def resolve_ref(ref: str, *, what: str = "factory", option: str = "--factory"):
    """Import ``"pkg.mod:qualname"`` and return the object.

    Refuses references into the standard library, builtins or torch itself: a snapshot must not
    be able to make the analyzer call ``os:system``. The current directory is importable so
    that a user's own training package resolves when run from the project root.
    """
    if not isinstance(ref, str) or ref.count(":") != 1:
        raise FactoryError(f"{what} reference {ref!r} is not of the form 'pkg.module:function'",
                           fix=f"pass {option} pkg.module:function")
    module, qualname = ref.split(":")
    root = module.split(".")[0]
    if root in _REFUSED_ROOTS:
        raise FactoryError(
            f"refusing {what} {ref!r}: it resolves into the standard library, builtins or torch, "
            "not into model code",
            fix=f"pass your own model code with {option} pkg.module:function",
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception as e:  # noqa: BLE001 - any import-time failure of user code is reported
        raise FactoryError(
            f"cannot import {what} {ref!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            fix=f"run from the directory that makes it importable, or pass {option} pkg.module:function",
        ) from e
    if not callable(obj):
        raise FactoryError(f"{what} {ref!r} is not callable", fix=f"pass {option} pkg.module:function")
    return obj

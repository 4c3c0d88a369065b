"""Load snapshots and resolve factory / loss_fn references, with version and safety checks.

Run directories and foreign logs are read by ``analyzer.runs``; checkpoints by ``analyzer.inspect``.
"""
from __future__ import annotations

import functools
import os
import pickle
import re
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

__all__ = ["load_snapshot", "plan_imports", "resolve_ref", "snapshot_roots", "torch_load_safe"]


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


def resolve_ref(ref: str, *, what: str = "factory", option: str = "--factory", roots=(),
                explicit: bool = False):
    """Import the function or class ``"pkg.mod:name"`` names, under the import rule.

    The rule (``recorders.schema``, the import-rule section) refuses anything but a function or
    class defined in the module named, and imports a module only from an import root (`roots`:
    ``--path`` and the run's recorded cwd; the current directory is always one) or from
    amp-autopsy's own modules, never from the standard library, torch or site-packages, and
    never when another file would shadow it. ``explicit=True`` (``--factory``/``--loss-fn``) is
    the user's own say-so: the module may live anywhere, the form rule still holds.

    The callable returned runs inside ``schema.import_roots(roots)``, so a builder's class
    argument (HF's ``model_class``) is imported under the same roots, and ``sys.path`` is back
    to what it was between calls.
    """
    roots = tuple(roots)
    try:
        obj = schema.import_ref(ref, roots, explicit=explicit, what=what)
    except schema.ImportRuleError as e:
        raise FactoryError(str(e), fix=_ref_fix(e.kind, option)) from e
    except Exception as e:  # noqa: BLE001 - any import-time failure of user code is reported
        raise FactoryError(
            f"cannot import {what} {ref!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            fix=_ref_fix("missing", option),
        ) from e

    def call_under_roots(*args, **kwargs):
        with schema.import_roots(roots):
            return obj(*args, **kwargs)

    return functools.update_wrapper(call_under_roots, obj, updated=())


def _ref_fix(kind: str, option: str) -> str:
    if kind == "missing":
        return (f"pass --path DIR for the directory that holds the package, or run from it; or name it "
                f"yourself with {option} pkg.module:function, which is also found through PYTHONPATH")
    if kind == "form":
        return f"pass {option} pkg.module:function"
    return f"if you trust that code, name it yourself with {option} pkg.module:function"


def snapshot_roots(snap: dict, paths=()) -> tuple[str, ...]:
    """Import roots for a snapshot's references: ``--path`` roots first, then the recorded cwd.

    (The current directory is always added last by the rule itself.) A recorded cwd that is not
    an absolute path is ignored: older snapshots have none.
    """
    cwd = snap.get("cwd") if isinstance(snap, dict) else None
    recorded = (cwd,) if isinstance(cwd, str) and os.path.isabs(cwd) else ()
    return tuple(os.path.abspath(p) for p in paths) + recorded


def plan_imports(snap: dict, *, factory: str | None = None, loss_fn: str | None = None,
                 paths=()) -> list[dict]:
    """What replaying `snap` would import, from which file, and whether the rule allows it.

    Imports nothing (``analyzer replay --show``). One dict per reference: the factory, the
    loss function, and a built-in builder's class argument (HF's ``model_class``), with keys
    ``role``, ``ref``, ``file``, ``allowed``, ``why``, ``kind`` (``schema.RefPlan.kind``) and
    ``explicit``.
    """
    roots = snapshot_roots(snap, paths)
    rows = []
    for role, given, recorded in (("factory", factory, snap.get("factory")), ("loss_fn", loss_fn, snap.get("loss_fn"))):
        ref = given or recorded
        plan = schema.plan_ref(ref, roots, explicit=bool(given), what=role)
        rows.append({"role": role, "ref": ref, "file": plan.file, "allowed": plan.allowed, "why": plan.why,
                     "kind": plan.kind, "explicit": bool(given)})
        builder = schema.BUILDER_CLASS_ARGS.get(ref) if role == "factory" and plan.allowed else None
        kwargs = snap.get("factory_kwargs")
        if builder and isinstance(kwargs, dict):
            arg, base, libraries = builder
            sub = schema.plan_ref(kwargs.get(arg), roots, libraries=libraries, what=arg)
            rows.append({"role": f"factory_kwargs.{arg}", "ref": kwargs.get(arg), "file": sub.file,
                         "allowed": sub.allowed, "why": f"{sub.why}; must subclass {base}" if sub.allowed
                         else sub.why, "kind": sub.kind, "explicit": False})
    return rows

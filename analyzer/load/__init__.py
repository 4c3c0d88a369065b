"""Every reader: files on disk -> validated objects, each with its format-version check.

Nothing here knows the analyses. Torch files are read with ``weights_only`` under archive and
nesting bounds (``torchfile``); snapshots (``snapshot``) and the user code they name (``refs``);
run directories (``run_dir``) and foreign training logs (``logs``) into one ``Run``;
checkpoints and safetensors (``checkpoint``, ``safetensors``) for ``analyzer inspect``.

NB: the readers of torch files are imported on first use (``__getattr__``): ``analyzer report``
reads Parquet and JSON only, and must not pay for ``import torch``.
"""
from __future__ import annotations

import importlib

from .run import Run, SnapshotInfo, progress_line, step_frame
from ._limits import ARCHIVE_RATIO_ENV, DEFAULT_ARCHIVE_RATIO, archive_ratio_limit
from .logs import IMPORTED_LOGS, TFEVENTS_PREFIX
from .run_dir import load_run, read_meta, snapshot_info
from .versions import check_format_version

__all__ = ["ARCHIVE_RATIO_ENV", "DEFAULT_ARCHIVE_RATIO", "IMPORTED_LOGS", "INSTALLED_SAMPLES", "TFEVENTS_PREFIX",
           "Checkpoint", "Entry", "Run", "Snapshot", "SnapshotInfo", "archive_ratio_limit", "check_format_version",
           "import_plan", "load_checkpoint", "load_run", "load_snapshot", "plan_imports", "progress_line",
           "read_meta", "recorded_cwd", "resolve_ref", "root_sources", "samples_package", "samples_roots",
           "snapshot_info", "snapshot_roots", "step_frame", "torch_load_safe"]

# name -> the submodule that defines it; these import torch
_LAZY = {
    "Checkpoint": "checkpoint", "Entry": "checkpoint", "load_checkpoint": "checkpoints",
    "INSTALLED_SAMPLES": "refs", "import_plan": "refs", "plan_imports": "refs", "resolve_ref": "refs",
    "samples_package": "refs", "samples_roots": "refs", "snapshot_roots": "refs", "recorded_cwd": "refs", "root_sources": "refs",
    "Snapshot": "snapshot", "load_snapshot": "snapshot",
    "torch_load_safe": "torchfile",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

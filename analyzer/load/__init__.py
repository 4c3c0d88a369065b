"""Every reader: files on disk -> validated objects, each with its format-version check.

Nothing here knows the analyses. Torch files are read with ``weights_only`` under archive and
nesting bounds (``torchfile``); snapshots (``snapshot``) and the user code they name (``refs``);
run directories (``run_dir``) and foreign training logs (``logs``) into one ``Run``;
checkpoints and safetensors (``checkpoint``, ``safetensors``) for ``analyzer inspect``.
"""
from __future__ import annotations

from .checkpoint import Checkpoint, Entry, load_checkpoint
from .refs import INSTALLED_SAMPLES, plan_imports, recorded_cwd, resolve_ref, root_sources, samples_package, samples_roots, snapshot_roots
from .run import Run, progress_line, step_frame
from .run_dir import load_run, read_meta, snapshot_info
from .snapshot import Snapshot, load_snapshot
from .torchfile import torch_load_safe
from .versions import check_format_version

__all__ = ["INSTALLED_SAMPLES", "Checkpoint", "Entry", "Run", "Snapshot", "check_format_version", "load_checkpoint", "load_run",
           "load_snapshot", "plan_imports", "progress_line", "read_meta", "recorded_cwd", "resolve_ref", "root_sources", "samples_package", "samples_roots",
           "snapshot_info", "snapshot_roots", "step_frame", "torch_load_safe"]

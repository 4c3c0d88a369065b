"""Read a recorder snapshot (one failing step, ``RUN/snapshots/*.pt``): version check and validation.

User-code references in it are resolved by ``refs``; the file itself is read by ``torchfile``.
"""
from __future__ import annotations

import os
from typing import Any

from recorders import schema

from ..errors import BadInputError
from ._validate import validate_snapshot
from .torchfile import torch_load_safe
from .versions import check_format_version

__all__ = ["load_snapshot"]


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

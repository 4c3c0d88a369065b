"""One format-version check for every artifact the analyzer reads (runs, snapshots)."""
from __future__ import annotations

import os
from typing import Any

from recorders import schema

from ..errors import BadInputError, VersionError

__all__ = ["check_format_version"]


def check_format_version(obj: dict[str, Any], *, path: str | os.PathLike, what: str) -> int:
    """Return ``obj["format_version"]``; raise when it is missing or newer than this analyzer's.

    Args:
        obj: a loaded snapshot or meta.json dict.
        path: the file it came from, named in the error.
        what: ``"snapshot"`` or ``"run"``, for the message.
    """
    version = obj.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise BadInputError(f"{what} has no integer format_version", path=path, fix="re-record the run")
    if version < 0:
        raise BadInputError(f"{what} format_version {version} is negative", path=path,
                            fix="the file is damaged or foreign; re-record the run")
    if version > schema.FORMAT_VERSION:
        raise VersionError(
            f"{what} format version {version} is newer than this analyzer's {schema.FORMAT_VERSION}",
            path=path, fix="upgrade amp-autopsy: pip install -U amp-autopsy")
    return version

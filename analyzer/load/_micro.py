"""A snapshot's ``micro_batches`` entry (format 6): every micro-batch of an accumulating step, validated.

``batch`` is then the list of the step's micro-batches and the entry says how their losses were
combined (``recorders.schema.MICRO_BATCH_KEYS``); replay re-runs them all (``replay._accumulate``).
"""
from __future__ import annotations

import math
import os
from typing import Any

from recorders import schema

from ..errors import BadInputError

__all__ = ["validate_micro_batches"]

_FIX = "the snapshot is damaged or was not written by the amp-autopsy Recorder; re-record the run"


def _bad(path: str | os.PathLike, detail: str) -> BadInputError:
    return BadInputError(f"snapshot 'micro_batches' {detail}", path=path, fix=_FIX)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_micro_batches(snap: dict[str, Any], path: str | os.PathLike) -> None:
    """Check the entry against ``MICRO_BATCH_KEYS`` and the batch list it describes; None passes."""
    mb = snap.get("micro_batches")
    if mb is None:
        return
    if not isinstance(mb, dict) or tuple(mb) != schema.MICRO_BATCH_KEYS:
        keys = list(mb) if isinstance(mb, dict) else type(mb).__name__
        raise _bad(path, f"must be a dict with keys {list(schema.MICRO_BATCH_KEYS)}, got {keys}")
    batch = snap.get("batch")
    count = mb["count"]
    if not _int(count) or count < 1:
        raise _bad(path, f"count {count!r} is not an int >= 1")
    if not isinstance(batch, list) or len(batch) != count:
        held = f"a list of {len(batch)}" if isinstance(batch, list) else f"a {type(batch).__name__}"
        raise _bad(path, f"count is {count} but the batch is {held}")
    if mb["combine"] not in schema.MICRO_BATCH_COMBINES:
        raise _bad(path, f"combine {mb['combine']!r} is not one of {sorted(schema.MICRO_BATCH_COMBINES)}")
    div = mb["divisor"]
    if not isinstance(div, (int, float)) or isinstance(div, bool) or not math.isfinite(div) or div <= 0:
        raise _bad(path, f"divisor {div!r} is not a positive finite number")
    if not isinstance(mb["source"], str) or len(mb["source"]) > 64:
        raise _bad(path, "source is not a short string")
    n = mb["num_items_in_batch"]
    if n is not None and (not _int(n) or n < 0):
        raise _bad(path, f"num_items_in_batch {n!r} is not None or an int >= 0")

"""The ``ddp`` entry of snapshots and meta.json (format 9, ``recorders.schema.DDP_KEYS``), read safely.

``read_ddp`` checks every value a Recorder writes there (what shapes DDP's gradient all-reduce: the
communication hook, the dtype of the sum, where the division by the world size happens) and raises
``ValueError`` naming the bad field; the snapshot reader turns that into one ``BadInputError``.

Example:
    >>> read_ddp({"world_size": 2, "comm_hook": "fp16_compress_hook", "reduce_dtype": "float16",
    ...           "divide": "before"})["comm_hook"]
    'fp16_compress_hook'
"""
from __future__ import annotations

from typing import Any

from recorders import schema

__all__ = ["read_ddp"]

_DTYPES = ("float16", "bfloat16", "float32", "float64")
_BOOLS = ("gradient_as_bucket_view", "broadcast_buffers", "find_unused_parameters")


def _int(entry: dict, key: str, low: int) -> None:
    v = entry.get(key)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not low <= v < 2**63):
        raise ValueError(f"{key} should be None or an integer >= {low}, got {v!r}"[:200])


def read_ddp(entry: Any) -> dict[str, Any] | None:
    """None, or the ``ddp`` entry with every ``DDP_KEYS`` key (absent ones None), values checked."""
    if entry is None:
        return None
    if not isinstance(entry, dict) or not set(entry) <= set(schema.DDP_KEYS):
        raise ValueError(f"should be None or a dict with keys {list(schema.DDP_KEYS)}")
    out = {k: entry.get(k) for k in schema.DDP_KEYS}
    _int(out, "world_size", 1)
    _int(out, "bucket_cap_bytes", 0)
    if out["comm_hook"] is not None and out["comm_hook"] not in schema.DDP_HOOKS:
        raise ValueError(f"comm_hook should be None or one of {list(schema.DDP_HOOKS)}, got {out['comm_hook']!r}"[:200])
    name = out["comm_hook_name"]
    if name is not None and not (isinstance(name, str) and len(name) <= 300):
        raise ValueError("comm_hook_name should be None or a name of at most 300 characters")
    if out["reduce_dtype"] is not None and out["reduce_dtype"] not in _DTYPES:
        raise ValueError(f"reduce_dtype should be None or one of {list(_DTYPES)}, got {out['reduce_dtype']!r}"[:200])
    if out["divide"] not in (None, "before"):
        raise ValueError(f"divide should be None or 'before', got {out['divide']!r}"[:200])
    for key in _BOOLS:
        if out[key] is not None and not isinstance(out[key], bool):
            raise ValueError(f"{key} should be None, True or False, got {out[key]!r}"[:200])
    mp = out["mixed_precision"]
    if mp is not None and (not isinstance(mp, dict) or not all(
            isinstance(k, str) and (v is None or v in _DTYPES) for k, v in mp.items())):
        raise ValueError("mixed_precision should be None or a dict of dtype names (or None)")
    return out

"""What the command line says over a snapshot's word: ``--factory-kwargs JSON``, applied to the loaded value.

A snapshot (or a checkpoint read as one, ``adhoc``) records the keyword arguments its factory is
called with (``factory_kwargs``). ``--factory-kwargs '{"width": 64}'`` gives them on the command
line: the JSON object is merged over the recorded ones (a key given replaces the recorded value),
and the ``Snapshot`` value replay consumes carries the result, so nothing downstream changes.

Example:
    >>> parse_factory_kwargs('{"width": 64, "depth": 2}')
    {'width': 64, 'depth': 2}
"""
from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType
from typing import Any

from ..errors import BadInputError
from ._limits import check_nesting

__all__ = ["MAX_KWARGS_TEXT", "parse_factory_kwargs", "with_factory_kwargs"]

MAX_KWARGS_TEXT = 1 << 20
_FIX = "pass a JSON object of the factory's keyword arguments, e.g. --factory-kwargs '{\"width\": 64}'"


def parse_factory_kwargs(text: str) -> dict[str, Any]:
    """The JSON object `text` names; one ``BadInputError`` for bad JSON, a non-object, or one too large or deep."""
    if len(text) > MAX_KWARGS_TEXT:
        raise BadInputError(f"--factory-kwargs is {len(text)} characters long (at most {MAX_KWARGS_TEXT})", fix=_FIX)
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        why = e.msg if isinstance(e, json.JSONDecodeError) else " ".join(str(e).split())[:120]
        at = f" at character {e.pos}" if isinstance(e, json.JSONDecodeError) else ""
        raise BadInputError(f"--factory-kwargs is not valid JSON ({why}{at})", fix=_FIX) from e
    if not isinstance(obj, dict):
        raise BadInputError(f"--factory-kwargs is a JSON {_json_kind(obj)}, not an object", fix=_FIX)
    check_nesting(obj, path="--factory-kwargs", what="--factory-kwargs")
    return obj


def with_factory_kwargs(snap, kwargs: dict[str, Any] | None):
    """`snap` (a ``Snapshot`` or ``CheckpointSnapshot``) with `kwargs` merged over its ``factory_kwargs``;
    `snap` itself when `kwargs` is None. A checkpoint's notes say where the arguments came from."""
    if kwargs is None:
        return snap
    merged = {**(snap.factory_kwargs or {}), **kwargs}
    raw = MappingProxyType({**snap._raw, "factory_kwargs": merged})
    extra = {}
    if hasattr(snap, "notes"):  # a checkpoint and a batch: its notes list what stood in for what
        keys = ", ".join(sorted(kwargs))[:200] or "none"
        extra["notes"] = (*snap.notes, f"factory keyword arguments from --factory-kwargs ({keys})")
        if isinstance(getattr(snap, "source", None), dict):
            extra["source"] = {**snap.source, "notes": list(extra["notes"])}
    return dataclasses.replace(snap, factory_kwargs=merged, _raw=raw, **extra)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _json_kind(obj: Any) -> str:
    if isinstance(obj, list):
        return "array"
    if isinstance(obj, str):
        return "string"
    if obj is None:
        return "null"
    if isinstance(obj, bool):
        return "boolean"
    return "number"

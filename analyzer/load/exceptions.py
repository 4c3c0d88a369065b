"""The ``exception`` entry of meta.json and of an ``exception`` snapshot (format 4), validated.

The recorder writes it when the training loop raised inside its ``with`` block
(``recorders/_exception.py``, keys ``schema.EXCEPTION_KEYS``). Files are not trusted: every field is
checked for its type and bounded in size, and anything else is refused with one ``ValueError``.

Example:
    >>> read_exception({"type": "RuntimeError", "message": "boom", "frames": ["t.py:3 in main: f()"],
    ...                 "step": 5, "last_step": 5, "failure": True})["step"]
    5
"""
from __future__ import annotations

from typing import Any

from recorders import schema

__all__ = ["read_exception", "raised_text"]

_MAX_TEXT = 4000
_MAX_FRAMES = 32


def _int_or_none(v: Any, key: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not -2**63 <= v < 2**63:
        raise ValueError(f"exception {key} should be an integer step or null, got {v!r}"[:200])
    return int(v)


def read_exception(value: Any) -> dict[str, Any] | None:
    """None, or the entry as a plain dict with every ``schema.EXCEPTION_KEYS`` key; ValueError if malformed."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(k in value for k in ("type", "message")):
        raise ValueError("exception should be null or an object with 'type' and 'message'")
    for key in ("type", "message"):
        if not isinstance(value[key], str) or len(value[key]) > _MAX_TEXT:
            raise ValueError(f"exception {key} should be a string of at most {_MAX_TEXT} characters")
    frames = value.get("frames") or []
    if not isinstance(frames, list) or len(frames) > _MAX_FRAMES or \
            not all(isinstance(f, str) and len(f) <= _MAX_TEXT for f in frames):
        raise ValueError(f"exception frames should be a list of at most {_MAX_FRAMES} strings")
    failure = value.get("failure", True)
    if not isinstance(failure, bool):
        raise ValueError("exception failure should be true or false")
    out = {"type": value["type"], "message": value["message"], "frames": list(frames),
           "step": _int_or_none(value.get("step"), "step"), "last_step": _int_or_none(value.get("last_step"), "last_step"),
           "failure": failure}
    assert tuple(out) == schema.EXCEPTION_KEYS
    return out


def raised_text(entry: dict[str, Any], limit: int = 300) -> str:
    """One line: ``RuntimeError: message (at train.py:42 in main: clip_grad_norm_(...))``.

    The frame is the innermost of the user's own code (the frames the recorder kept, innermost last).
    """
    message = " ".join(str(entry.get("message", "")).split())
    if len(message) > limit:
        message = message[: limit - 3] + "..."
    frames = entry.get("frames") or []
    frame = next((f for f in reversed(frames) if "/torch/" not in f and "site-packages" not in f),
                 frames[-1] if frames else None)
    kind = " ".join(str(entry.get("type")).split())[:200]
    return (f"{kind}: {message}" if message else kind) + (f" (at {' '.join(str(frame).split())})" if frame else "")

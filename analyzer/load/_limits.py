"""Limits on what a small hostile file may make the analyzer allocate.

``torch.save`` stores tensor data uncompressed, so a genuine archive declares about as many bytes
as it holds. A re-zipped (deflated) file can declare far more: a 1 MB zip bomb made ``torch.load``
take 2.3 GB. Archives whose declared uncompressed size exceeds ``max_archive_ratio()`` times the
file's size (plus ``_SLACK`` bytes) are refused before anything is decompressed.

Raise the limit with ``analyzer --max-archive-ratio N ...`` or ``AMP_AUTOPSY_MAX_ARCHIVE_RATIO=N``;
from Python, pass the ratio for a block of reads:

    >>> with archive_ratio_limit(10000):            # doctest: +SKIP
    ...     snap = load_snapshot("trusted-deflated.pt")
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from ..errors import BadInputError

__all__ = ["DEFAULT_ARCHIVE_RATIO", "ARCHIVE_RATIO_ENV", "archive_ratio_limit", "max_archive_ratio",
           "MAX_NESTING", "archive_budget", "check_nesting", "gc_paused", "MAX_JSON_DIGITS", "NumberTooLong", "json_int", "json_loads",
           "safe_strings"]

DEFAULT_ARCHIVE_RATIO = 4.0
ARCHIVE_RATIO_ENV = "AMP_AUTOPSY_MAX_ARCHIVE_RATIO"
_SLACK = 1 << 20  # small files (a few KiB of pickle) may declare up to 1 MiB regardless
# Deepest dict/list/tuple nesting read from any file (JSON, batches, checkpoints). Real batches and
# checkpoints nest a handful of levels; Python's recursion limit is 1000.
MAX_NESTING = 100
# Longest integer read from a JSON file: int64 has 19 digits; Python refuses over 4300 with a
# ValueError deep in json.loads, and a long one costs quadratic time to convert.
MAX_JSON_DIGITS = 100

# The ratio given for the reads in progress (archive_ratio_limit); a ContextVar, so a value given
# for one command or thread never leaks into another.
_GIVEN: ContextVar[float | None] = ContextVar("amp_autopsy_max_archive_ratio", default=None)


@contextlib.contextmanager
def archive_ratio_limit(ratio: float | None) -> Iterator[None]:
    """Within the block, torch files may declare up to `ratio` times their size uncompressed.

    Args:
        ratio: the limit (the CLI's ``--max-archive-ratio``); None: the environment variable,
            else ``DEFAULT_ARCHIVE_RATIO``.
    """
    if ratio is not None and not ratio > 0:
        raise ValueError(f"max archive ratio must be positive, got {ratio!r}")
    token = _GIVEN.set(ratio)
    try:
        yield
    finally:
        _GIVEN.reset(token)


def max_archive_ratio() -> float:
    """The ratio in force: the one given (``archive_ratio_limit``), else the environment variable, else the default."""
    given = _GIVEN.get()
    if given is not None:
        return given
    raw = os.environ.get(ARCHIVE_RATIO_ENV)
    try:
        value = float(raw) if raw else DEFAULT_ARCHIVE_RATIO
    except ValueError:
        return DEFAULT_ARCHIVE_RATIO
    return value if value > 0 else DEFAULT_ARCHIVE_RATIO


def archive_budget(file_size: int, ratio: float | None = None) -> int:
    """Declared uncompressed bytes allowed for an archive of `file_size` bytes (`ratio`: else the one in force)."""
    return int((max_archive_ratio() if ratio is None else ratio) * file_size) + _SLACK


def check_nesting(obj: Any, *, path: str | os.PathLike, what: str, limit: int = MAX_NESTING) -> None:
    """Refuse dict/list/tuple nesting deeper than `limit`, without recursing.

    Walking (or printing) a 100k-deep list recursively raises RecursionError; real files nest a
    handful of levels, so anything deeper is refused at load.
    """
    # A container shared many times over (torch.load keeps shared references) is walked again only
    # when reached deeper than before, so a DAG costs at most nodes x limit steps, not its unfolding.
    deepest: dict[int, int] = {}
    stack = [(obj, 1)]
    while stack:
        cur, depth = stack.pop()
        if isinstance(cur, dict):
            children = cur.values()
        elif isinstance(cur, (list, tuple)):
            children = cur
        else:
            continue
        if deepest.get(id(cur), 0) >= depth:
            continue
        deepest[id(cur)] = depth
        if depth > limit:
            raise BadInputError(f"{what} is nested more than {limit} levels deep", path=path,
                                fix="real files nest a few levels; this one is damaged or hostile")
        stack.extend((c, depth + 1) for c in children)


class NumberTooLong(ValueError):
    """A JSON integer with more than ``MAX_JSON_DIGITS`` digits (``json_int``); callers name the file."""


def json_int(text: str) -> int:
    """``json.loads(..., parse_int=json_int)``: an integer, or NumberTooLong for an absurdly long one."""
    digits = len(text) - text.startswith("-")
    if digits > MAX_JSON_DIGITS:
        raise NumberTooLong(f"holds a number with {digits} digits (more than {MAX_JSON_DIGITS}: no value a "
                            "training run records is that long)")
    return int(text)


_DIGITS = str.maketrans("123456789", "000000000")


def json_loads(text: str) -> Any:
    """``json.loads`` that refuses an integer longer than ``MAX_JSON_DIGITS`` digits (NumberTooLong).

    JSON numbers are ASCII digits: an ASCII text without a run of more digits than that holds no
    such integer, and is parsed by the C scanner alone (about half the time of ``json_int``, a
    Python call per integer: 0.06 s over 1,000 ranks' meta files). Any other text takes ``json_int``.
    """
    if text.isascii() and "0" * (MAX_JSON_DIGITS + 1) not in text.translate(_DIGITS):
        return json.loads(text)
    return json.loads(text, parse_int=json_int)


def _safe(s: str) -> str:
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:  # a lone surrogate ("\\udcff" in the JSON): printing or polars would fail
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def safe_strings(obj: Any) -> Any:
    """`obj` (parsed JSON: dicts, lists, scalars) with every string made encodable, without recursing.

    A lone surrogate is written as its escape (``\\udcff``), so names read from a file can be
    formatted, printed and handed to polars. Containers are updated in place.
    """
    if isinstance(obj, str):
        return _safe(obj)
    stack, seen = [obj], set()
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, dict):
            for k in list(cur):
                v = cur[k]
                if isinstance(k, str) and _safe(k) is not k:
                    del cur[k]
                    k = _safe(k)
                cur[k] = _safe(v) if isinstance(v, str) else v
                if isinstance(v, (dict, list)):
                    stack.append(v)
        elif isinstance(cur, list):
            for i, v in enumerate(cur):
                if isinstance(v, str):
                    cur[i] = _safe(v)
                elif isinstance(v, (dict, list)):
                    stack.append(v)
    return obj


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic GC off while a file's many small acyclic containers are built (the header of a
    safetensors file listing 300,000 tensors took 5.9 s to parse with it, 1.7 s without); restored as
    it was. Bounds nothing: memory is freed by reference counting as usual."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()

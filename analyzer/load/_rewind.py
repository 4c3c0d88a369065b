"""A snapshot's ``rewind`` entry (format 8, ``Recorder(rewind=K)``): the window's start state and steps, validated.

The entry (``recorders.schema.REWIND_KEYS``) holds the weights and optimizer state at a start step and every
step from it to the snapshot's own (``REWIND_STEP_KEYS``: batch, RNG, the trace row's values, whether the
optimizer stepped and with which hyperparameters). ``analyzer replay SNAPSHOT --steps K`` runs them
(``analyzer/replay/window``). Everything is checked here, so that the replay trusts it: one
``BadInputError`` naming the file and the field for anything the Recorder never writes.
"""
from __future__ import annotations

import math
import os
from typing import Any

from recorders import schema

from ..errors import BadInputError
from ._dense import check_dense
from ._micro import validate_micro_batches
from ._validate import check_named_tensors, check_optimizer_entry, walk_tensors
from .rngfile import check_rng_state

__all__ = ["validate_rewind", "MAX_REWIND_STEPS"]

MAX_REWIND_STEPS = 1 << 16  # Recorder(rewind=K) keeps up to 2K steps; a longer list is no Recorder's
_MAX_GROUPS = 1024
_FIX = "the snapshot is damaged or was not written by the amp-autopsy Recorder; re-record the run"


def _bad(path, detail: str) -> BadInputError:
    return BadInputError(f"snapshot 'rewind' {detail}"[:300], path=path, fix=_FIX)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63


def _real_or_none(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _hyper_value(v: Any) -> bool:
    if v is None or isinstance(v, bool):
        return True
    if isinstance(v, (int, float)):
        return not isinstance(v, float) or not math.isnan(v)
    return isinstance(v, (list, tuple)) and len(v) <= 8 and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)


def _check_step(s: Any, i: int, path) -> None:
    where = f"steps[{i}]"
    if not isinstance(s, dict) or set(s) != set(schema.REWIND_STEP_KEYS):
        raise _bad(path, f"{where} should be a dict with keys {list(schema.REWIND_STEP_KEYS)}")
    if not _int(s["step"]):
        raise _bad(path, f"{where} step should be an integer, got {s['step']!r}")
    for key in ("loss", "scale", "grad_norm", "lr"):
        if not _real_or_none(s[key]):
            raise _bad(path, f"{where} {key} should be a number or None, got {type(s[key]).__name__}")
    if s["scale"] is not None and not s["scale"] >= 0:  # NaN fails too
        raise _bad(path, f"{where} scale {s['scale']!r} is not a loss scale (a number >= 0)")
    for key in ("skipped", "optimizer_stepped"):
        if s[key] is not None and not isinstance(s[key], bool):
            raise _bad(path, f"{where} {key} should be True, False or None, got {type(s[key]).__name__}")
    groups = s["param_groups"]
    if groups is not None and not (isinstance(groups, list) and len(groups) <= _MAX_GROUPS and all(
            isinstance(g, dict) and all(isinstance(k, str) and len(k) <= 64 and _hyper_value(v) for k, v in g.items())
            for g in groups)):
        raise _bad(path, f"{where} param_groups should be None or a list of dicts of hyperparameters (numbers)")
    for name, t in walk_tensors(s["batch"], f"rewind['steps'][{i}]['batch']"):
        check_dense(t, path=path, where=name)
    check_rng_state(s["rng"], path=path, what=f"snapshot 'rewind' {where} rng", fix=_FIX)
    if s["micro_batches"] is not None:
        try:
            validate_micro_batches({"micro_batches": s["micro_batches"], "batch": s["batch"]}, path)
        except BadInputError as e:
            raise _bad(path, f"{where} micro_batches: {e.message.removeprefix('snapshot ')}") from e


def validate_rewind(snap: dict[str, Any], path: str | os.PathLike) -> None:
    """Check the ``rewind`` entry against ``REWIND_KEYS`` and the snapshot's own step; None passes."""
    rw = snap.get("rewind")
    if rw is None:
        return
    if not isinstance(rw, dict) or set(rw) != set(schema.REWIND_KEYS):
        keys = sorted(map(str, rw))[:8] if isinstance(rw, dict) else type(rw).__name__
        raise _bad(path, f"should be None or a dict with keys {list(schema.REWIND_KEYS)}, got {keys}")
    k = rw["steps_asked"]
    if not _int(k) or not 1 <= k <= MAX_REWIND_STEPS:
        raise _bad(path, f"steps_asked should be an integer from 1 to {MAX_REWIND_STEPS}, got {k!r}")
    if not _int(rw["start_step"]):
        raise _bad(path, f"start_step should be an integer, got {rw['start_step']!r}")
    if not isinstance(rw["model_state"], dict) or not rw["model_state"]:
        raise _bad(path, "model_state should be a non-empty dict of name -> tensor")
    check_named_tensors(rw["model_state"], "rewind", "model_state", path)
    if rw["optimizer"] is None:
        raise _bad(path, "optimizer should be the optimizer's state at the window's start, got None")
    check_optimizer_entry(rw["optimizer"], path, key="rewind")
    steps = rw["steps"]
    if not isinstance(steps, list) or not 1 <= len(steps) <= MAX_REWIND_STEPS:
        n = len(steps) if isinstance(steps, list) else type(steps).__name__
        raise _bad(path, f"steps should be a list of 1 to {MAX_REWIND_STEPS} steps, got {n}")
    for i, s in enumerate(steps):
        _check_step(s, i, path)
    numbers = [s["step"] for s in steps]
    if numbers[0] != rw["start_step"] or numbers[-1] != snap.get("step"):
        raise _bad(path, f"steps run from {numbers[0]} to {numbers[-1]}, but the window starts at "
                   f"{rw['start_step']} and the snapshot is of step {snap.get('step')}")
    if any(b <= a for a, b in zip(numbers, numbers[1:])):
        raise _bad(path, "steps are not in increasing order")

"""Snapshot values that pass the type checks (``_validate``) but no training run records.

``validate_snapshot`` checks types and ranges; this module checks what the values mean, and either
refuses a snapshot that cannot be what the Recorder saved, with one error naming the file, the
field, the value and what to do, or returns notes for values a replay can still use, which the
loaded ``Snapshot`` carries (``Snapshot.load_notes``) so that replay prints them before its verdict:

- ``device_type`` that is not a torch device type (``"banana"``): refused; the Recorder writes
  ``device.type`` (``cpu``, ``cuda``, ``mps``, ...).
- ``scale`` NaN or negative: refused; GradScaler's scale is a number >= 0 (0 after it underflowed).
  A scale an FP16 backward cannot survive (above 2**40, e.g. 1.27e30) or inf: a note; replayed as recorded.
- integer weights: a tensor the snapshot's optimizer trained (``optimizer.param_names``), or every
  tensor of ``model_state``, of an integer dtype is refused: autograd trains floating-point
  parameters only. Integer ``weight``/``bias`` entries beside floating-point ones (a quantized
  layer) are a note.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch

from ..errors import BadInputError

__all__ = ["snapshot_notes", "FP16_SCALE_LIMIT"]

FP16_SCALE_LIMIT = 2.0**40  # a gradient above 65504 / 2**40 (6e-8) overflows FP16 under such a scale
_FIX = "the snapshot was edited or written by other code; replay a snapshot the Recorder wrote, or re-record the run"


def _bad(path, key: str, detail: str, fix: str = _FIX) -> BadInputError:
    return BadInputError(f"snapshot {key!r} {detail}"[:300], path=path, fix=fix)


def _device(snap: dict, path) -> None:
    v = snap.get("device_type")
    try:
        torch.device(v)
    except (RuntimeError, TypeError, ValueError) as e:
        raise _bad(path, "device_type", f"{str(v)[:40]!r} is not a torch device type (cpu, cuda, mps, ...)") from e


def _scale(snap: dict, path) -> list[str]:
    raw = snap.get("scale")
    if raw is None:
        return []
    try:
        s = float(raw)
    except OverflowError:  # an int of 400 digits: validated a number, but no float holds it
        s = math.inf
    if math.isnan(s) or s < 0:
        raise _bad(path, "scale", f"{str(raw)[:40]} is not a loss scale (GradScaler's is a number >= 0)")
    if snap.get("amp_dtype") == "float16" and s > FP16_SCALE_LIMIT or math.isinf(s):
        return [f"the recorded loss scale {s:.3g} is beyond any an FP16 backward survives (every gradient above "
                f"{65504 / s:.2g} overflows under it): was the snapshot edited? replayed with it as recorded"]
    return []


def _integer_weights(snap: dict, path) -> list[str]:
    state: dict[str, Any] = snap.get("model_state") or {}
    ints = {k: t for k, t in state.items() if not (t.is_floating_point() or t.is_complex())}
    if not ints:
        return []
    opt = snap.get("optimizer")
    trained = set(opt.get("param_names") or []) if isinstance(opt, dict) else set()
    named = sorted(k for k in ints if k in trained)
    if named:
        k = named[0]
        raise _bad(path, "model_state", f"entry {k!r} is {str(ints[k].dtype).removeprefix('torch.')}, but the "
                   "optimizer trained it: a trained parameter is floating point")
    if len(ints) == len(state):
        shown = ", ".join(f"{k}: {str(t.dtype).removeprefix('torch.')}" for k, t in list(ints.items())[:3])
        raise _bad(path, "model_state", f"holds no floating-point tensor ({shown}{', ...' if len(ints) > 3 else ''}): "
                   "integer weights were never trained in mixed precision")
    weights = sorted(k for k in ints if k.rsplit(".", 1)[-1] in ("weight", "bias"))
    if not weights:
        return []  # integer buffers (num_batches_tracked, position ids) are what models hold
    return [f"model_state holds integer weights ({', '.join(weights[:3])}{', ...' if len(weights) > 3 else ''}: "
            f"{str(ints[weights[0]].dtype).removeprefix('torch.')}): the rebuilt model loads them as its own "
            "dtypes; a replay of a quantized layer is not the training step"]


def snapshot_notes(snap: dict, path: str | os.PathLike) -> list[str]:
    """Refuse values no Recorder writes (BadInputError); return notes on odd values a replay can use."""
    _device(snap, path)
    return _scale(snap, path) + _integer_weights(snap, path)

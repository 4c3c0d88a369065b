"""Scalar values read from a checkpoint (a GradScaler's scale and growth tracker, step counters),
checked before ``int()``/``float()`` sees them: a value no training run saves is named in the
checkpoint's ``implausible`` list (inspect's ``implausible_checkpoint``), never used or dropped in silence."""
from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["number", "read_scaler", "read_step"]


def number(v: Any, kind: type) -> int | float | None:
    """v as a Python int/float if it is one (bools aside) or a one-element tensor, else None: values read
    from a file are checked before ``int()``/``float()`` sees them."""
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_complex() and v.layout == torch.strided:
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if kind is int and (isinstance(v, float) and not v.is_integer()):
        return None
    return kind(v) if kind is float or abs(v) < 2**63 else None


def _shown(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {str(v.dtype).removeprefix('torch.')} tensor of shape {list(v.shape)}"
    return repr(v)[:40] if not isinstance(v, str) else repr(v[:40])


def read_scaler(d: dict, where: str, ckpt: Any) -> None:
    """A GradScaler state into ``ckpt.scaler``; a scale that is not a finite number >= 0 (0: halved to underflow)
    (NaN, inf, a string, None, a tensor of several values) or a growth tracker that is not a count
    goes to ``ckpt.implausible`` instead, naming the value."""
    scale, tracker = number(d.get("scale"), float), d.get("_growth_tracker")
    if scale is None or not math.isfinite(scale) or scale < 0:  # 0: a scale halved to underflow, a real collapse
        ckpt.implausible.append(f"{where}.scale {_shown(d.get('scale'))} is not a GradScaler scale (a finite "
                                "number >= 0); the scale is not reported")
        return
    count = number(tracker, int)
    if tracker is not None and (count is None or count < 0):
        ckpt.implausible.append(f"{where}._growth_tracker {_shown(tracker)} is not a count of steps")
    ckpt.scaler = {"path": where, "scale": scale, "growth_tracker": count if count is not None and count >= 0 else None}


def read_step(v: Any, where: str, ckpt: Any) -> int | None:
    """A step counter: a whole number in [0, 2**63) (an int, an integral float, a one-element tensor);
    anything else is named in ``ckpt.implausible`` and read as unknown."""
    n = number(v, int)
    if n is not None and 0 <= n < 2**63:
        return n
    ckpt.implausible.append(f"{where} {_shown(v)} is not a step number (a whole number from 0 to 2**63)")
    return None

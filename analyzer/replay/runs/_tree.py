"""``map_tensors``: one function applied to every tensor of a nest of dicts, lists and tuples (a batch, a state)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["map_tensors"]


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`obj` with each tensor leaf replaced by ``fn(leaf)``; dicts, lists and tuples rebuilt, other leaves kept.

    Example:
        >>> map_tensors({"x": [torch.ones(1)], "n": 3}, lambda t: t * 2)
        {'x': [tensor([2.])], 'n': 3}
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn) for v in obj)
    return obj

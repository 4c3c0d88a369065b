"""A ``--batch`` file that holds a list of micro-batches: replayed as gradient accumulation, or joined on request.

``analyzer replay CHECKPOINT --batch FILE``: when FILE holds a list of at least two micro-batches
(dicts, tuples or lists of one structure, each holding a tensor, as ``torch.save(mbs, FILE)`` of a
loop's ``mbs = [next(it) for _ in range(4)]``), each is its own forward and backward, and their
gradients add up as training accumulated them. What no file says is how training normalised each
micro-batch's loss; ``--accumulate`` says it, and the default is named in the replay's notes:

- ``auto`` (default): HF's ``num_items_in_batch`` when every micro-batch carries it (the model
  divides by the whole step's item count itself), otherwise ``mean``;
- ``mean``: each loss divided by the number of micro-batches (``loss / N``, the usual loop);
- ``sum``: each loss as the loss function returns it, undivided;
- ``join``: one batch, the micro-batches' concatenation (the replay of a mean loss over it is the
  accumulated step's when the micro-batches are equally sized).

Odd lists are one ``BadInputError`` each: an empty list, micro-batches of different structures,
a list that mixes micro-batches with tensors or values, a list of lists of micro-batches.

Example:
    >>> batch, notes, micro = micro_batch_file([{"x": torch.ones(2, 4)}] * 4, "mbs.pt", "auto", fix="")
    >>> micro
    {'count': 4, 'combine': 'mean', 'divisor': 4.0, 'source': 'batch_file', 'num_items_in_batch': None}
"""
from __future__ import annotations

import os
from typing import Any

import torch

from recorders import schema
from recorders.micro_batches import batch_structure, holds_tensor

from ..errors import BadInputError

__all__ = ["ACCUMULATE", "micro_batch_file"]

ACCUMULATE = ("auto", "mean", "sum", "join")
_CONTAINERS = (dict, list, tuple)


def _is_micro_list(obj: Any) -> bool:
    """Whether a file's `obj` is meant as micro-batches: a list holding any dict, list or tuple (a list
    of bare tensors is one batch), or a tuple of containers only (``(x, y)`` is one batch)."""
    if type(obj) is list:
        return any(isinstance(m, _CONTAINERS) for m in obj)
    return isinstance(obj, tuple) and bool(obj) and all(isinstance(m, _CONTAINERS) for m in obj)


def _check(parts: list, path: str | os.PathLike, fix: str) -> None:
    """Every micro-batch a container holding a tensor, of the first one's structure, none a list of micro-batches."""
    def bad(detail: str) -> BadInputError:
        return BadInputError(f"holds a list of {len(parts)} micro-batches: {detail}", path=path, fix=fix)

    for i, m in enumerate(parts):
        if not isinstance(m, _CONTAINERS):
            kinds = sorted({type(p).__name__ for p in parts})
            raise bad(f"item {i} is a {type(m).__name__}, not a micro-batch (the list mixes {', '.join(kinds)})")
        if type(m) is list and m and all(isinstance(v, _CONTAINERS) for v in m):
            raise bad(f"item {i} is itself a list of micro-batches (nested lists)")
        if not holds_tensor(m):
            raise bad(f"micro-batch {i} holds no tensor")
    first = batch_structure(parts[0])
    for i, m in enumerate(parts[1:], 1):
        if batch_structure(m) != first:
            raise bad(f"micro-batch {i} differs from micro-batch 0 in its keys, nesting or tensor dtypes")


def _num_items(part: Any) -> int | None:
    n = part.get("num_items_in_batch") if isinstance(part, dict) else None
    if isinstance(n, torch.Tensor) and n.numel() == 1 and not n.is_floating_point():
        return int(n.item())
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def micro_batch_file(obj: Any, path: str | os.PathLike, accumulate: str, *,
                     fix: str) -> tuple[Any, list[str], dict | None]:
    """``(batch, notes, micro_batches entry or None)`` for what a ``--batch`` file holds.

    A single batch (a tensor, a dict, a tuple of tensors, a list of one micro-batch) comes back as
    it is, with no entry. A list of micro-batches comes back as the list, with the snapshot's
    ``micro_batches`` entry (``schema.MICRO_BATCH_KEYS``, source ``"batch_file"``), or joined
    (``accumulate="join"``). Raises ``BadInputError`` for the odd lists of the module doc.
    """
    if accumulate not in ACCUMULATE:
        raise BadInputError(f"unknown --accumulate {accumulate!r}", fix=f"pass one of {', '.join(ACCUMULATE)}")
    if isinstance(obj, (list, tuple)) and not obj:
        raise BadInputError(f"holds an empty {type(obj).__name__}: no batch", path=path, fix=fix)
    if not _is_micro_list(obj):
        return obj, [], None  # a tensor, a dict, or one batch of tensors and values
    parts = list(obj)
    _check(parts, path, fix)
    if len(parts) == 1:
        return parts[0], [], None
    n = len(parts)
    if accumulate == "join":
        return _join_micro_batches(parts, path, fix), [
            f"the batch file holds {n} micro-batches: replayed as one batch, their concatenation (--accumulate "
            "join; the same per-sample values, and a mean loss over it is the accumulated step's when they are "
            "equally sized)"], None
    items = [_num_items(p) for p in parts]
    if accumulate == "auto":
        accumulate = "num_items_in_batch" if all(i is not None for i in items) else "mean"
    divisor = float(n) if accumulate == "mean" else 1.0
    entry = {"count": n, "combine": accumulate, "divisor": divisor, "source": "batch_file",
             "num_items_in_batch": items[0] if accumulate == "num_items_in_batch" else None}
    assert tuple(entry) == schema.MICRO_BATCH_KEYS and accumulate in schema.MICRO_BATCH_COMBINES
    how = {"mean": f"each loss divided by {n} (loss / N per micro-batch, the usual loop)",
           "sum": "each loss as the loss function returns it, undivided (--accumulate sum)",
           "num_items_in_batch": f"each micro-batch carries HF's num_items_in_batch ({items[0]}): the model "
                                 "divides by the whole step's item count itself"}[accumulate]
    other = "; pass --accumulate sum if training did not divide" if accumulate == "mean" else ""
    return parts, [f"the batch file holds {n} micro-batches: replayed as gradient accumulation, each its own "
                   f"forward and backward, {how}{other}, --accumulate join to replay their concatenation as one "
                   "batch"], entry


def _join_micro_batches(parts: list, path, fix) -> Any:
    first = parts[0]
    try:
        if isinstance(first, dict):
            if any(not isinstance(p, dict) or p.keys() != first.keys() for p in parts):
                raise ValueError("the micro-batches have different keys")
            return {k: _join([p[k] for p in parts]) for k in first}
        if any(not isinstance(p, (list, tuple)) or len(p) != len(first) for p in parts):
            raise ValueError("the micro-batches have different lengths")
        return type(first)(_join([p[i] for p in parts]) for i in range(len(first)))
    except (ValueError, RuntimeError, TypeError) as e:
        raise BadInputError(f"holds {len(parts)} micro-batches that cannot be joined into one batch "
                            f"({' '.join(str(e).split())[:160]})", path=path,
                            fix="replay them as accumulation (leave out --accumulate join), " + fix) from e


def _join(values: list) -> Any:
    if all(isinstance(v, torch.Tensor) for v in values):
        if any(v.dim() == 0 for v in values):
            raise ValueError("a 0-d tensor has no batch dimension")
        return torch.cat(values)
    if all(v == values[0] for v in values):  # a flag or a shared value
        return values[0]
    raise ValueError("a non-tensor entry differs between micro-batches")

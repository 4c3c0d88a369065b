"""Gradient accumulation: which batch is a list of micro-batches, and how their losses were combined.

A step that accumulates gradients runs one forward and backward per micro-batch and sums the
gradients. Its snapshot holds every micro-batch (``batch`` is then their list) and the
``micro_batches`` entry says how each micro-batch's loss was normalised before its backward, so
that replay can re-run them all and accumulate as training did (``schema.MICRO_BATCH_KEYS``).

Nothing here runs on the hot path: the callbacks hold the micro-batches by reference, the plain
API's list is recognised when a snapshot is written, and copies to the CPU happen only then.
"""
from __future__ import annotations

from typing import Any

import torch

from . import schema

__all__ = ["MicroBatches", "is_micro_batch_list", "batch_structure", "holds_tensor"]


def batch_structure(obj: Any) -> Any:
    """The structure of a batch, without sizes (an epoch's last micro-batch may be shorter): containers,
    keys, and per tensor its dtype and ndim. Two micro-batches of one step have equal structures."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.dtype, obj.ndim)
    if isinstance(obj, dict):
        return ("dict", tuple((k, batch_structure(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(batch_structure(v) for v in obj))
    return ("leaf", type(obj).__name__)


def holds_tensor(obj: Any) -> bool:
    """Whether `obj` is a tensor or a dict, list or tuple with a tensor somewhere inside."""
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(holds_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_tensor(v) for v in obj)
    return False


def is_micro_batch_list(batch: Any, declared: int | None) -> bool:
    """Whether `batch` given to ``begin_step`` is a list of micro-batches rather than one batch.

    A ``list`` (not a tuple) of at least two containers (dicts, tuples or lists) of the same
    structure, each holding a tensor: ``[{"x": x0, "y": y0}, {"x": x1, "y": y1}]``. A list of bare
    tensors (``[x, y]``) is one batch. With ``Recorder(micro_batches=N)`` declared, the list holds
    at most N (fewer at an epoch's end), so ``micro_batches=1`` keeps a list of containers one batch
    (a loss function that takes the whole list).
    """
    if type(batch) is not list or len(batch) < 2 or (declared is not None and len(batch) > declared):
        return False
    if not all(isinstance(b, (dict, tuple, list)) and holds_tensor(b) for b in batch):
        return False
    first = batch_structure(batch[0])
    return all(batch_structure(b) == first for b in batch[1:])


def _num_items(batch: Any) -> int | None:
    """HF Trainer's ``num_items_in_batch`` kwarg of a micro-batch, when present (an int or a 0-d tensor)."""
    n = batch.get("num_items_in_batch") if isinstance(batch, dict) else None
    if isinstance(n, torch.Tensor) and n.numel() == 1:
        return int(n.item())  # NB: host sync, at snapshot time only
    return n if isinstance(n, int) and not isinstance(n, bool) else None


class MicroBatches:
    """The accumulation of the current step, as declared by a callback or recognised in the batch.

    Args:
        declared: ``Recorder(micro_batches=...)``: forwards per step, or None.
    """

    def __init__(self, declared: int | None):
        self.declared = declared
        self._how: tuple[str, float | None, str] | None = None  # this step's (combine, divisor, source)

    def begin(self) -> None:
        """A new step: what a callback declared for the last one no longer holds."""
        self._how = None

    def declare(self, combine: str, divisor: float | None, source: str) -> None:
        """The current step's batch is the list of its micro-batches (a framework callback).

        Args:
            combine: a key of ``schema.MICRO_BATCH_COMBINES``.
            divisor: what each micro-batch's loss was divided by before its backward; None: the
                number of micro-batches the snapshot holds.
            source: who declared it (``"hf_trainer"``, ``"lightning"``).
        """
        if combine not in schema.MICRO_BATCH_COMBINES:
            raise ValueError(f"combine must be one of {sorted(schema.MICRO_BATCH_COMBINES)}, got {combine!r}")
        self._how = (combine, divisor, source)

    def entry(self, batch: Any) -> dict | None:
        """The snapshot's ``micro_batches`` entry for `batch` (``schema.MICRO_BATCH_KEYS``), or None."""
        if self._how is not None and isinstance(batch, list) and batch:
            combine, divisor, source = self._how
        elif is_micro_batch_list(batch, self.declared):
            combine, divisor, source = "mean", None, "list"
        else:
            return None
        count = len(batch)
        entry = {"count": count, "combine": combine, "divisor": float(count if divisor is None else divisor),
                 "source": source, "num_items_in_batch": _num_items(batch[0])}
        assert tuple(entry) == schema.MICRO_BATCH_KEYS
        return entry

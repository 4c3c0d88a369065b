"""Gradient accumulation in a replay: every micro-batch of the step, each loss normalised as training did.

A snapshot whose ``micro_batches`` entry is set (format 6, ``recorders/_micro.py``) holds the
step's micro-batches as a list. ``run_once`` then runs one forward and one backward per
micro-batch, in order, from the RNG state of the first (training drew from it in the same order),
with ``(loss / divisor * scale).backward()``: the gradients add up in ``.grad`` as they did in
training. The ops of all micro-batches form one trace; ``RunTrace.micro_starts`` says where each
micro-batch's ops begin, so the culprit's op index names its micro-batch (0-based): the
``micro_batch`` probe (``probes/micro_batch.py``).
"""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..result.trace import RunTrace

__all__ = ["micro_parts", "scaled_loss", "step_loss", "micro_of", "input_micro"]


def micro_parts(micro: dict | None, batch: Any) -> list[tuple[Any, float | None]]:
    """``[(micro_batch, divisor)]`` in training's order; one ``(batch, None)`` without accumulation."""
    if micro is None:
        return [(batch, None)]
    return [(part, float(micro["divisor"])) for part in batch]


def scaled_loss(loss: torch.Tensor, scale: float, divisor: float | None) -> torch.Tensor:
    """What one micro-batch's backward starts from: ``loss * scale``, the loss first divided by `divisor`
    (``micro_parts``) as training did."""
    return loss.float() * scale if divisor is None else loss.float() / divisor * scale


def step_loss(micro: dict | None, values: list[float]) -> float:
    """The step's loss from its micro-batches' (one without accumulation): each divided as training did, summed."""
    return values[0] if micro is None else sum(v / float(micro["divisor"]) for v in values)


def micro_of(trace: RunTrace | None, index: int | None) -> int | None:
    """The micro-batch (0-based) whose forward or backward ran op `index` of `trace`."""
    starts = getattr(trace, "micro_starts", None)
    if not starts or index is None:
        return None
    return max(0, bisect.bisect_right(starts, index) - 1)


def input_micro(name: str, count: int) -> int | None:
    """``batch:2.x`` -> 2: the micro-batch a non-finite batch leaf belongs to (the batch is their list)."""
    kind, _, where = name.partition(":")
    head = where.split(".", 1)[0]
    if kind != "batch" or not head.isdigit() or int(head) >= count:
        return None
    return int(head)

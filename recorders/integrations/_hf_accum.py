"""How many micro-batches the HF Trainer accumulates in one optimizer step, and so what it divides each loss by.

``Trainer._inner_training_loop`` fetches an optimizer step's micro-batches before the first forward
(``get_batch_samples``): ``gradient_accumulation_steps`` of them, or the epoch's remainder for the
last step of an epoch whose dataloader length N does not divide evenly. Without
``num_items_in_batch`` the Trainer divides each micro-batch's loss by that count
(``current_gradient_accumulation_steps``), so an optimizer step interrupted in its third
micro-batch still divided its first three losses by four. With ``num_items_in_batch`` the model
divides by the whole step's item count, which the Trainer also counts before the first forward
and passes in every micro-batch's inputs.

Example:
    >>> step_micro_batches(4, 10, 0), step_micro_batches(4, 10, 2), step_micro_batches(4, None, 2)
    (4, 2, 4)
"""
from __future__ import annotations

from typing import Any

__all__ = ["step_micro_batches", "dataloader_length"]


def step_micro_batches(accum: int, length: int | None, global_step: int) -> int:
    """The micro-batches of the optimizer step that begins at `global_step` (HF's count of steps done).

    Args:
        accum: ``gradient_accumulation_steps``.
        length: the training dataloader's length (its micro-batches per epoch), or None when it has none
            (an iterable dataset: the Trainer then takes every step as ``accum`` long).
        global_step: ``state.global_step`` at ``on_step_begin``.
    """
    if not length or length < 1:
        return accum
    per_epoch = max(length // accum + int(length % accum > 0), 1)  # Trainer.set_initial_training_values
    remainder = length % accum or accum
    return remainder if global_step % per_epoch == per_epoch - 1 else accum


def dataloader_length(dataloader: Any) -> int | None:
    """``len(dataloader)`` as the Trainer's ``has_length`` takes it; None for a dataloader without one."""
    try:
        n = len(dataloader)
    except (TypeError, NotImplementedError, AttributeError):
        return None
    return n if isinstance(n, int) and n > 0 else None

"""HF Trainer runs without the recorder: ``save_batch_on_nan`` keeps the inputs of the first training forward
whose loss is not finite, for ``analyzer replay CHECKPOINT --batch FILE``; and the loss of a model's output,
which the recorder's callback reads too."""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from transformers import TrainerCallback

__all__ = ["save_batch_on_nan", "loss_of"]


def loss_of(output: Any) -> torch.Tensor | None:
    """The scalar loss of a model's output (``.loss``, ``["loss"]``, or a 0-d first element), or None."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        loss = output[0] if output[0].ndim == 0 else None
    return loss


class _SaveBatchOnNan(TrainerCallback):
    """See :func:`save_batch_on_nan`."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.saved_step: int | None = None
        self._seen: list[tuple[dict, torch.Tensor, dict]] = []
        self._handles: list = []
        self._inputs: dict | None = None
        self._rng: dict | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and not self._handles:
            self._handles = [model.register_forward_pre_hook(self._before, with_kwargs=True),
                             model.register_forward_hook(self._after, with_kwargs=True)]

    def _before(self, module, args, kwargs):
        self._inputs = dict(kwargs) if module.training and self.saved_step is None else None
        if self._inputs is not None:  # the forward's draws (dropout) start from here; NB: host-side, no sync
            cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
            self._rng = {"cpu": torch.get_rng_state(), "cuda": cuda}

    def _after(self, module, args, kwargs, output):
        loss = loss_of(output) if self._inputs is not None else None
        if loss is not None:
            self._seen.append((self._inputs, loss.detach(), self._rng))
        self._inputs = self._rng = None

    def on_step_end(self, args, state, control, **kwargs):
        seen, self._seen = self._seen, []
        if not seen or self.saved_step is not None:
            return
        ok = torch.stack([loss.float().reshape(()) for _, loss, _ in seen]).isfinite().tolist()  # one host sync per step
        bad = next((entry for entry, fine in zip(seen, ok) if not fine), None)
        if bad is None:
            return
        batch = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in bad[0].items()}
        tmp = f"{self.path}.tmp"
        torch.save({"batch": batch, "rng": bad[2]}, tmp)  # the RNG state beside it: the forward's dropout masks
        os.replace(tmp, self.path)  # a crash leaves the old file or the new one, never half of one
        self.saved_step = state.global_step - 1  # on_step_end comes after global_step += 1
        warnings.warn(f"amp-autopsy: the loss of step {self.saved_step} is not finite: its batch is saved in "
                      f"{self.path}; replay it on the last checkpoint with: analyzer replay CHECKPOINT --batch "
                      f"{self.path}", stacklevel=2)

    def on_train_end(self, args, state, control, **kwargs):
        for h in self._handles:
            h.remove()
        self._handles = []


def save_batch_on_nan(path: str | os.PathLike) -> TrainerCallback:
    """A ``TrainerCallback`` that saves the inputs of the first training forward whose loss is NaN/Inf.

    For a run without the recorder: ``analyzer replay CHECKPOINT --batch PATH`` then replays that
    batch on a checkpoint (``output_dir/checkpoint-N``). The model's keyword inputs (what the
    Trainer passes to ``model(**inputs)``) are saved with ``torch.save`` as a dict of CPU tensors;
    with gradient accumulation, the micro-batch whose loss is not finite. Beside it goes the RNG
    state taken right before that forward, so the replay draws the same dropout masks:
    ``{"batch": inputs, "rng": {"cpu": torch.get_rng_state(), "cuda": [...] | None}}``. It costs one
    host sync per optimizer step (the finiteness check), a copy of the CPU generator's state (5 KB)
    per forward, and keeps no copy of any batch until one fails.

    NB: the checkpoint holds the weights of its own step, not those of the failing step; the
    closer the checkpoint (``save_steps``), the closer the replay to the step that failed.

    Example:
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds,
        ...                   callbacks=[save_batch_on_nan("nan_batch.pt")])  # doctest: +SKIP
        >>> # analyzer replay out/checkpoint-500 --batch nan_batch.pt
    """
    return _SaveBatchOnNan(path)

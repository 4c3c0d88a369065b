"""HF Trainer adapter: ``AmpAutopsyCallback``, a ``transformers.TrainerCallback`` over the Recorder.

All recording logic lives in :class:`recorders.Recorder`; this module only maps Trainer events
onto ``begin_step`` / ``end_step`` / ``close``:

================================  ===========================================================
Trainer event                     what the callback does
================================  ===========================================================
``on_train_begin``                builds the Recorder (model, optimizer, GradScaler, AMP dtype
                                  are only known once the Trainer has prepared them)
``on_step_begin``                 remembers ``state.global_step`` as the step number
first training forward of a step  a forward pre-hook (``with_kwargs=True``) calls
                                  ``begin_step(step, inputs)``: the Trainer calls
                                  ``model(**inputs)``, so the keyword arguments *are* the batch;
                                  a forward hook keeps ``outputs.loss``
``on_pre_optimizer_step``         ``end_step(loss)``: after backward (and after gradient
                                  clipping), before ``optimizer.step()``
``on_train_end``                  ``close()``: flushes the trace, removes the hooks
================================  ===========================================================

The snapshot has to rebuild the model offline. For a ``PreTrainedModel`` the callback fills
``factory`` / ``loss_fn`` itself with the two helpers below, so nothing needs to be written::

    factory        = "recorders.integrations.hf:build_pretrained"
    factory_kwargs = {"model_class": "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel",
                      "config": model.config.to_dict()}
    loss_fn        = "recorders.integrations.hf:pretrained_loss"   # model(**batch).loss

Pass ``factory=`` / ``factory_kwargs=`` / ``loss_fn=`` to override (any other ``nn.Module``, or a
Trainer with a custom ``compute_loss``).

NB: AMP on CPU. ``TrainingArguments(use_cpu=True, bf16=True)`` runs CPU autocast in BF16.
``fp16=True`` with ``use_cpu=True`` is *accepted without a word* by transformers/accelerate and
then trains in plain FP32: accelerate creates neither autocast nor a GradScaler for FP16 on CPU.
The callback records such a run as FP32 (``amp_dtype=None``) and warns once.

NB: gradient accumulation. ``begin_step`` sees the first micro-batch of each optimizer step, so
with ``gradient_accumulation_steps > 1`` the snapshot holds that micro-batch only and a replay
re-runs it alone. Use ``gradient_accumulation_steps=1`` (the default) for exact replays.

Example:
    >>> from transformers import Trainer, TrainingArguments
    >>> from recorders.integrations.hf import AmpAutopsyCallback
    >>> trainer = Trainer(model=model, args=TrainingArguments("out", bf16=True, use_cpu=True),
    ...                   train_dataset=ds, callbacks=[AmpAutopsyCallback("runs/exp1")])
    >>> trainer.train()            # doctest: +SKIP
    >>> # analyzer report runs/exp1 ; analyzer replay runs/exp1/snapshots/step00000003-r00000-nonfinite_loss.pt
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch
from transformers import PreTrainedModel, TrainerCallback

from .. import imports
from ..recorder import Recorder
from ..refs import import_class

__all__ = ["AmpAutopsyCallback", "build_pretrained", "pretrained_loss", "pretrained_factory_kwargs"]

# Where model_class may come from besides the import roots: the framework itself (the import rule).
_LIBRARIES = imports.BUILDER_CLASS_ARGS["recorders.integrations.hf:build_pretrained"][2]


def build_pretrained(model_class: str, config: dict) -> PreTrainedModel:
    """Rebuild a ``PreTrainedModel`` from its class reference and ``config.to_dict()``.

    The weights come from the snapshot afterwards, so this only needs the architecture: no
    download, no checkpoint. ``model_class`` must name a ``PreTrainedModel`` subclass defined in
    the module the reference names, which lies in transformers or under an import root (the
    import rule in ``recorders.imports``).

    Example:
        >>> m = build_pretrained("transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel",
        ...                      {"vocab_size": 32, "n_embd": 16, "n_layer": 1, "n_head": 2})
        >>> type(m).__name__
        'GPT2LMHeadModel'
    """
    cls = import_class(model_class, PreTrainedModel, "model_class", libraries=_LIBRARIES)
    return cls(cls.config_class.from_dict(dict(config)))


def pretrained_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The loss the default ``Trainer.compute_loss`` takes: ``model(**batch).loss``."""
    out = model(**batch)
    return out["loss"] if isinstance(out, dict) else out[0]


def pretrained_factory_kwargs(model: PreTrainedModel) -> dict:
    """``{"model_class": "module:Class", "config": {...}}`` for :func:`build_pretrained` (JSON-safe)."""
    cls = type(model)
    return {
        "model_class": f"{cls.__module__}:{cls.__qualname__}",
        "config": json.loads(model.config.to_json_string(use_diff=False)),
    }


def _loss_of(output: Any) -> torch.Tensor | None:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        loss = output[0] if output[0].ndim == 0 else None
    return loss


class AmpAutopsyCallback(TrainerCallback):
    """Record a Trainer run with a :class:`recorders.Recorder`; snapshot failing steps.

    Args:
        run_dir: where the Recorder writes ``meta.json``, ``trace/`` and ``snapshots/``.
        factory, factory_kwargs, loss_fn: as for ``Recorder``. Default: filled in for a
            ``PreTrainedModel`` (see the module docstring); required for any other model.
        amp_dtype: ``"auto"`` (default) reads it from ``TrainingArguments`` and the accelerator:
            ``bf16=True`` gives BF16, ``fp16=True`` gives FP16 when accelerate made a GradScaler
            for it, otherwise FP32 (``None``). Pass a dtype (or ``None``) to override.
        **recorder_kwargs: passed to ``Recorder`` as they are (``layer_every``, ``flush_every``,
            ``max_snapshots``, ``sync_failures``, ``enabled``, ...).

    ``callback.recorder`` is the Recorder once training has begun.
    """

    def __init__(self, run_dir: str | os.PathLike, *, factory=None, factory_kwargs: dict | None = None,
                 loss_fn=None, amp_dtype: Any = "auto", **recorder_kwargs: Any):
        if not hasattr(TrainerCallback, "on_pre_optimizer_step"):
            raise ImportError(
                "AmpAutopsyCallback needs the TrainerCallback.on_pre_optimizer_step event "
                "(transformers>=4.45): pip install -U 'amp-autopsy[hf]'"
            )
        self.run_dir = run_dir
        self.factory = factory
        self.factory_kwargs = factory_kwargs
        self.loss_fn = loss_fn
        self.amp_dtype = amp_dtype
        self.recorder_kwargs = recorder_kwargs
        self.recorder: Recorder | None = None
        self._handles: list = []
        self._step: int | None = None  # set by on_step_begin, consumed by the first forward
        self._loss: torch.Tensor | None = None
        self._in_step = False
        self._warned_args = False

    # ---------------------------------------------------------------- Trainer events

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.recorder is not None and not self.recorder.closed:
            return
        scaler = getattr(optimizer, "scaler", None)  # accelerate's AcceleratedOptimizer holds it
        inner = getattr(optimizer, "optimizer", optimizer)
        amp_dtype = self._amp_dtype(args, scaler, model)
        if getattr(args, "gradient_accumulation_steps", 1) > 1:
            warnings.warn(
                "amp-autopsy: gradient_accumulation_steps > 1: snapshots hold the first micro-batch "
                "of each step only, so a replay re-runs that micro-batch alone", stacklevel=2)
        factory, factory_kwargs, loss_fn = self._refs(model)
        self.recorder = Recorder(
            self.run_dir, model, factory=factory, factory_kwargs=factory_kwargs, loss_fn=loss_fn,
            scaler=scaler, amp_dtype=amp_dtype, optimizer=inner, **self.recorder_kwargs,
        )
        self._handles = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True),
        ]

    def on_step_begin(self, args, state, control, **kwargs):
        self._step = state.global_step  # optimizer steps done so far: this step's 0-based number
        self._loss = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.recorder is not None and self._in_step:
            self._in_step = False
            self.recorder.end_step(self._loss)
            self._loss = None

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Remove the hooks and close the Recorder (flushes the trace). Safe to call twice.

        NB: the Trainer has no exception event: if ``trainer.train()`` raises, call
        ``callback.close()`` in a ``finally`` to flush the steps not yet written.
        """
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.recorder is not None:
            self.recorder.close()

    # ---------------------------------------------------------------- model hooks

    def _before_forward(self, module, args, kwargs):
        if self._step is None or not module.training or self.recorder is None:
            return None  # eval / predict forwards, and later micro-batches of the step
        if args and not self._warned_args:
            self._warned_args = True
            warnings.warn("amp-autopsy: the model was called with positional inputs; only keyword "
                          "inputs are recorded as the batch", stacklevel=2)
        self.recorder.begin_step(self._step, dict(kwargs))
        self._step = None
        self._in_step = True
        return None

    def _after_forward(self, module, args, kwargs, output):
        if self._in_step and self._loss is None:
            loss = _loss_of(output)
            self._loss = None if loss is None else loss.detach()
        return None

    # ---------------------------------------------------------------- helpers

    def _amp_dtype(self, args, scaler, model) -> torch.dtype | None:
        if self.amp_dtype != "auto":
            return self.amp_dtype
        if getattr(args, "bf16", False):
            return torch.bfloat16
        if getattr(args, "fp16", False):
            on_cpu = next(model.parameters()).device.type == "cpu"
            if scaler is not None or not on_cpu:  # no torch GradScaler off CPU: DeepSpeed scales itself
                return torch.float16
            warnings.warn(
                "amp-autopsy: fp16=True but the Trainer made no GradScaler (accelerate runs FP16 "
                "on CPU as plain FP32, without autocast): recording the run as FP32", stacklevel=3)
        return None

    def _refs(self, model) -> tuple[Any, dict, Any]:
        factory, factory_kwargs, loss_fn = self.factory, self.factory_kwargs, self.loss_fn
        if isinstance(model, PreTrainedModel):
            if factory is None:
                factory = build_pretrained
                factory_kwargs = pretrained_factory_kwargs(model) if factory_kwargs is None else factory_kwargs
            if loss_fn is None:
                loss_fn = pretrained_loss
        if factory is None or loss_fn is None:
            raise ValueError(
                f"AmpAutopsyCallback: the model is a {type(model).__name__}, not a PreTrainedModel: "
                "pass factory='pkg.mod:build' (with factory_kwargs) and loss_fn='pkg.mod:loss' so "
                "that snapshots can be replayed"
            )
        return factory, dict(factory_kwargs or {}), loss_fn

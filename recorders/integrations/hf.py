"""HF Trainer adapter: ``AmpAutopsyCallback``, a ``transformers.TrainerCallback`` over the Recorder.

All recording logic lives in :class:`recorders.Recorder`; this module only maps Trainer events
onto ``begin_step`` / ``end_step`` / ``close``:

================================  ===========================================================
Trainer event                     what the callback does
================================  ===========================================================
``on_train_begin``                builds the Recorder (model, optimizer, GradScaler, AMP dtype
                                  are only known once the Trainer has prepared them)
``on_step_begin``                 takes ``state.global_step + 1`` as the step number: HF's own
                                  numbering (below)
first training forward of a step  a forward pre-hook (``with_kwargs=True``) calls
                                  ``begin_step(step, inputs)``: the Trainer calls
                                  ``model(**inputs)``, so the keyword arguments *are* the batch
every training forward            a forward hook keeps ``outputs.loss`` of each micro-batch
end of the step's last backward   ``end_step(loss)``: an autograd callback queued from a hook on
                                  the last micro-batch's loss runs once its backward is done,
                                  *before* the Trainer clips the gradients
``on_pre_optimizer_step``         ``end_step(loss)`` only when the backward did not pass
                                  through the model's loss (a custom ``compute_loss``): the
                                  gradients are then read after clipping, with a warning
``on_train_end``                  ``close()``: flushes the trace, removes the hooks
``with callback.guard():``        an exception out of ``trainer.train()``: the step it
                                  interrupted gets an ``exception`` snapshot and its trace row,
                                  meta.json records it, then ``close()``; re-raised unchanged
================================  ===========================================================

Step numbers are HF's: the optimizer step that ends with ``state.global_step == N`` is step N
(1 for the first), the number ``trainer_state.json``'s ``log_history``, the logged ``step`` and
``checkpoint-N`` use. meta.json says so (``"step_numbering": "hf_trainer"``).

Gradient norms are the raw ones: measured when the last micro-batch's backward is done, before
``max_grad_norm`` clipping, so the recorded total is the ``grad_norm`` HF logs.

The loss is the step's loss as HF logs it: with ``gradient_accumulation_steps=N`` the sum of the
N micro-batch losses when the model normalised them by the step's item count
(``num_items_in_batch``, recent transformers), else their mean, as ``Trainer.training_step``
scales them. NB: HF's ``logging_nan_inf_filter`` (on by default) logs a NaN/Inf loss as the
running mean; the trace keeps the real value.

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

Gradient accumulation. With ``gradient_accumulation_steps=N`` the callback keeps the inputs of all
N forwards of the step, by reference (no copy until a snapshot is written), and the snapshot holds
them as a list with how the Trainer combined their losses (``schema.MICRO_BATCH_KEYS``): divided by
the whole step's ``num_items_in_batch`` inside the model when it takes that argument, otherwise by
the step's micro-batch count (N, or the epoch's remainder: ``_hf_accum``). Both are fixed before the
step's first forward, so an ``exception`` snapshot of a step cut short keeps them. A replay re-runs
every micro-batch and accumulates their gradients as the Trainer did.

Example:
    >>> from transformers import Trainer, TrainingArguments
    >>> from recorders.integrations.hf import AmpAutopsyCallback
    >>> callback = AmpAutopsyCallback("runs/exp1")
    >>> trainer = Trainer(model=model, args=TrainingArguments("out", bf16=True, use_cpu=True),
    ...                   train_dataset=ds, callbacks=[callback])
    >>> with callback.guard():     # doctest: +SKIP
    ...     trainer.train()
    >>> # analyzer report runs/exp1 ; analyzer replay runs/exp1/snapshots/step00000004-r00000-nonfinite_loss.pt
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import torch
from transformers import PreTrainedModel, TrainerCallback

from .. import imports
from .._exception import record_exception
from ..recorder import Recorder
from ..refs import import_class
from ._hf_accum import dataloader_length, step_micro_batches
from ._hf_amp import trainer_amp_dtype
from ._hf_compile import trainer_compile_info
from ._hf_nan_batch import loss_of, save_batch_on_nan

__all__ = ["AmpAutopsyCallback", "build_pretrained", "pretrained_loss", "pretrained_factory_kwargs",
           "save_batch_on_nan"]

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


class _TrainerRecorder(Recorder):
    """A Recorder that records the Trainer's own compilation (``torch_compile=True``) of a model it sees uncompiled."""

    def __init__(self, *args, trainer_compile: dict | None = None, **kwargs):
        self._trainer_compile = trainer_compile
        super().__init__(*args, **kwargs)

    def _start(self) -> None:
        if self.compile is None:  # the Trainer compiles inside accelerate.prepare, after the callback saw the model
            self.compile = self._trainer_compile
        super()._start()


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
        self._batches: list[dict] = []  # this step's micro-batches (the model's kwargs), by reference
        self._losses: list[torch.Tensor] = []  # this step's micro-batch losses, on the device
        self._normalized = False  # the model divided its loss by the step's num_items_in_batch
        self._in_step = False
        self._step_number: int | None = None  # the current step's number, once begin_step ran
        self._queued = False  # the end-of-backward callback of this step is queued
        self._warned_args = False
        self._warned_clip = False
        self._accum = 1
        self._step_forwards = 1  # micro-batches of the current optimizer step, as the Trainer counted them
        self._token_scale = 1
        self._clips = False
        self._gradient_state = None

    # ---------------------------------------------------------------- Trainer events

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.recorder is not None and not self.recorder.closed:
            return
        scaler = getattr(optimizer, "scaler", None)  # accelerate's AcceleratedOptimizer holds it
        inner = getattr(optimizer, "optimizer", optimizer)
        pending: list[str] = []  # warned before the Recorder exists: kept once it does
        amp_dtype = self.amp_dtype if self.amp_dtype != "auto" else trainer_amp_dtype(args, scaler, model,
                                                                                        pending.append)
        self._accum = max(1, int(getattr(args, "gradient_accumulation_steps", 1) or 1))
        self._clips = (getattr(args, "max_grad_norm", 0) or 0) > 0
        try:  # a shared-state singleton: the Trainer sets sync_gradients before each micro-batch
            from accelerate.state import GradientState

            self._gradient_state = GradientState()
        except Exception:  # noqa: BLE001 - no usable accelerate: count the forwards instead
            self._gradient_state = None
        world = int(getattr(args, "world_size", 1) or 1)
        # Trainer.compute_loss multiplies a num_items_in_batch-normalised loss by the process count
        self._token_scale = world if getattr(args, "average_tokens_across_devices", False) and world > 1 else 1
        factory, factory_kwargs, loss_fn = self._refs(model)
        self.recorder = _TrainerRecorder(
            self.run_dir, model, trainer_compile=trainer_compile_info(args, model),
            factory=factory, factory_kwargs=factory_kwargs, loss_fn=loss_fn,
            scaler=scaler, amp_dtype=amp_dtype, optimizer=inner,
            **{"step_numbering": "hf_trainer", "micro_batches": self._accum, **self.recorder_kwargs},
        )
        for message in pending:
            self._warn("fp16_cpu_as_fp32", message)
        if self._accum > 1:
            self.recorder._update_meta(micro_batches_kept=True)  # every snapshot holds all N micro-batches
        self._handles = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True),
        ]

    def on_step_begin(self, args, state, control, train_dataloader=None, **kwargs):
        # HF's numbering: the global_step this optimizer step ends with (log_history, checkpoint-N)
        self._step = state.global_step + 1
        # what the Trainer divides each micro-batch's loss by without num_items_in_batch (_hf_accum)
        self._step_forwards = step_micro_batches(self._accum, dataloader_length(train_dataloader), state.global_step)
        self._losses = []
        self._batches = []
        self._queued = False

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.recorder is not None and self._in_step:  # the backward never reached the model's loss
            self._in_step = False
            if self._clips and not self._warned_clip:
                self._warned_clip = True
                self._warn(
                    "grads_post_clip",
                    f"amp-autopsy: step {self._step_number}'s backward did not run through the model's loss output "
                    "(a custom compute_loss or label smoothing?), so its gradients were read after HF clipped "
                    "them to max_grad_norm: the recorded gradient norms are post-clip", self._step_number)
            self.recorder.end_step(self._step_loss())

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    @contextlib.contextmanager
    def guard(self):
        """``with callback.guard(): trainer.train()``: keep the step an exception interrupts.

        The Trainer has no exception event. Inside ``guard()``, an exception raised by
        ``trainer.train()`` inside a step (the forward, ``compute_loss``, backward, gradient
        clipping, a NaN check of your own) gives that step an ``exception`` snapshot (pre-step
        weights, the batch, the RNG) and a trace row; meta.json records the exception in any case;
        the Recorder is closed. The exception is then re-raised unchanged.

        Example:
            >>> callback = AmpAutopsyCallback("runs/exp1")
            >>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback])  # doctest: +SKIP
            >>> with callback.guard():  # doctest: +SKIP
            ...     trainer.train()
        """
        try:
            yield self
        except BaseException as e:
            self.record_exception(e)
            raise

    def record_exception(self, exception: BaseException) -> None:
        """Keep the step `exception` interrupted (``Recorder.__exit__``'s record), then close. Never raises."""
        loss = self._step_loss() if self._in_step else None  # the micro-batches the forward hook kept
        self._losses = []
        self._in_step = False
        if self.recorder is not None:
            record_exception(self.recorder, exception, loss=loss)
        self.close()

    def close(self) -> None:
        """Remove the hooks and close the Recorder (flushes the trace). Safe to call twice.

        NB: the Trainer has no exception event: run ``trainer.train()`` inside ``with
        callback.guard():`` (or call ``callback.close()`` in a ``finally``) to keep the steps not
        yet written, and the step an exception interrupted.
        """
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.recorder is not None:
            self.recorder.close()

    # ---------------------------------------------------------------- model hooks

    def _before_forward(self, module, args, kwargs):
        if self._step is None and self._in_step and module.training and self._accum > 1:
            self._batches.append(dict(kwargs))  # a later micro-batch of the step: a reference, no copy
            return None
        if self._step is None or not module.training or self.recorder is None:
            return None  # eval / predict forwards
        if args and not self._warned_args:
            self._warned_args = True
            self._warn("positional_inputs", "amp-autopsy: the model was called with positional inputs; only keyword "
                       "inputs are recorded as the batch", self._step)
        if self._accum > 1:
            self._batches = [dict(kwargs)]  # grows with the step's forwards; the Recorder holds this list
            self.recorder.begin_step(self._step, self._batches)
            self._declare("num_items_in_batch" in kwargs)
        else:
            self.recorder.begin_step(self._step, dict(kwargs))
        self._step_number = self._step
        self._step = None
        self._in_step = True
        return None

    def _after_forward(self, module, args, kwargs, output):
        if not self._in_step or not module.training:
            return None
        loss = loss_of(output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return None
        self._losses.append(loss.detach())
        self._normalized = "num_items_in_batch" in kwargs
        if loss.requires_grad and not self._queued and self._last_micro_batch():
            loss.register_hook(self._on_loss_grad)
        return None

    def _declare(self, normalized: bool) -> None:
        """How the Trainer combines the micro-batch losses (``Trainer.training_step``): a model given
        ``num_items_in_batch`` divides each summed loss by the step's item count (times the process
        count under ``average_tokens_across_devices``); otherwise each loss is divided by N."""
        micro = getattr(self.recorder, "_micro", None)  # None: a disabled Recorder
        if micro is None:
            return
        if normalized:
            micro.declare("num_items_in_batch", 1.0 / self._token_scale, "hf_trainer")
        else:  # the step's micro-batch count, fetched before its first forward: an exception mid-step keeps it
            micro.declare("mean", float(self._step_forwards), "hf_trainer")

    def _last_micro_batch(self) -> bool:
        """Whether this forward's backward is the last before the optimizer step (accelerate's
        GradientState says so while the Trainer accumulates; without it, the count of forwards)."""
        if self._gradient_state is not None:
            return bool(self._gradient_state.sync_gradients)
        return len(self._losses) >= self._accum

    def _on_loss_grad(self, grad):
        # Runs inside the backward: queue the recording for when the whole backward is done.
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        return None

    def _after_backward(self) -> None:
        """End of the last micro-batch's backward: the gradients are final and not yet clipped."""
        if self.recorder is None or not self._in_step:
            return
        self._in_step = False
        try:
            self.recorder.end_step(self._step_loss())
        except Exception as e:  # noqa: BLE001 - raised inside the Trainer's backward: never take it down
            self._warn("step_not_recorded", f"amp-autopsy: step {self._step_number} not recorded "
                       f"({type(e).__name__}: {e})", self._step_number)

    def _step_loss(self) -> torch.Tensor | None:
        """The step's loss as Trainer.training_step returns and logs it, summed over micro-batches."""
        if not self._losses:
            return None
        # in the losses' own dtype: a BF16/FP16 loss (one computed outside autocast) stays visible
        total = self._losses[0] if len(self._losses) == 1 else torch.stack([x.reshape(()) for x in self._losses]).sum()
        if self._normalized:  # each micro-batch's loss is already a share of the step's mean
            return total * self._token_scale if self._token_scale != 1 else total
        # the Trainer divides each by the step's micro-batch count, also when an exception cut the step short
        return total / max(self._step_forwards, len(self._losses))

    # ---------------------------------------------------------------- helpers

    def _warn(self, kind: str, message: str, step: int | None = None) -> None:
        """One RecorderWarning of `kind` (``schema.WARNING_KINDS``), kept in meta.json's ``warnings`` like the
        Recorder's own (``analyzer report`` repeats it). Called once the Recorder exists."""
        self.recorder._recorder_warning(kind, message, stacklevel=3, step=step)

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

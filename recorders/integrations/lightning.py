"""Lightning adapter: ``AmpAutopsyCallback``, a ``lightning.pytorch.Callback`` over the Recorder.

All recording logic lives in :class:`recorders.Recorder`; this module maps Lightning hooks onto
``begin_step`` / ``end_step`` / ``close``:

=============================  ================================================================
Lightning hook                 what the callback does
=============================  ================================================================
``on_train_start``             builds the Recorder: the LightningModule, the first optimizer,
                               the precision plugin's GradScaler and AMP dtype
``on_train_batch_start``       ``begin_step(trainer.global_step, batch)`` at the first
                               micro-batch of each optimizer step (the batch is already on the
                               device; the RNG state is the one ``training_step`` uses); with
                               ``accumulate_grad_batches=N``, the list of the step's N batches
``on_before_backward``         adds up the step's loss, unscaled (the plugin hands over
                               ``scale * loss / accumulate_grad_batches``)
``on_before_optimizer_step``   ``end_step(loss)``: after the last backward, before gradient
                               clipping and ``optimizer.step()``
``on_train_end``               ``close()``: flushes the trace
``on_exception``               ``record_exception``: a step the exception interrupted gets an
                               ``exception`` snapshot and its trace row; meta.json records the
                               exception; then ``close()``
=============================  ================================================================

Step numbers are Lightning's ``trainer.global_step`` when the step starts (0 for the first),
the number the loggers write in ``metrics.csv``'s ``step`` column; meta.json says so
(``"step_numbering": "lightning"``). The loss is the step's: the mean of its micro-batches'
losses, what their backwards sum.

NB: with ``precision="16-mixed"`` the plugin calls ``scaler.unscale_(optimizer)`` *before*
``on_before_optimizer_step``. The Recorder reads the GradScaler's per-optimizer stage and does
not divide by the scale a second time.

The snapshot has to rebuild the model offline. By default the callback uses the two helpers
below, which need the LightningModule to call ``self.save_hyperparameters()`` in ``__init__``::

    factory        = "recorders.integrations.lightning:build_module"
    factory_kwargs = {"module_class": "pkg.mod:MyModule", "hparams": dict(module.hparams)}
    loss_fn        = "recorders.integrations.lightning:training_step_loss"  # module.training_step(batch, 0)

Pass ``factory=`` / ``factory_kwargs=`` / ``loss_fn=`` to override. ``training_step_loss`` calls
``training_step`` outside a Trainer, where ``self.log`` has nowhere to log (its warning is
silenced); a ``training_step`` that uses ``self.trainer``, or raises on a non-finite loss (replay
would stop at that check), needs a plain ``loss_fn`` of your own.

NB: AMP on CPU. ``Trainer(accelerator="cpu", precision="16-mixed")`` is silently turned into
``"bf16-mixed"`` by Lightning (it warns "AMP with fp16 is not supported on CPU"). Real FP16 with
a GradScaler on CPU works with an explicit plugin:
``plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]``.

Gradient accumulation. With ``accumulate_grad_batches=N > 1`` the callback keeps the step's N
batches by reference (copied to the CPU only when a snapshot is written); the snapshot holds their
list and says that each loss was divided by N, as Lightning does, so a replay re-runs them all and
accumulates their gradients.

Example:
    >>> import lightning as L
    >>> from recorders.integrations.lightning import AmpAutopsyCallback
    >>> trainer = L.Trainer(precision="bf16-mixed", callbacks=[AmpAutopsyCallback("runs/exp1")])
    >>> trainer.fit(module, loader)   # doctest: +SKIP
"""
from __future__ import annotations

import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from .. import imports
from .._exception import record_exception
from ..recorder import Recorder
from ..refs import import_class

__all__ = ["AmpAutopsyCallback", "build_module", "training_step_loss", "module_factory_kwargs"]

# Where module_class may come from besides the import roots: the framework itself (the import rule).
_LIBRARIES = imports.BUILDER_CLASS_ARGS["recorders.integrations.lightning:build_module"][2]

_AMP_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
# LightningModule.log outside a Trainer: "You are trying to `self.log()` but the `self.trainer` reference ..."
_NO_TRAINER_LOG = r"You are trying to `self\.log\(\)` but the `self\.trainer` reference is not registered"


def build_module(module_class: str, hparams: dict) -> pl.LightningModule:
    """Rebuild a LightningModule as ``module_class(**hparams)``.

    ``module_class`` must name a ``LightningModule`` subclass, ``"pkg.mod:Class"``, defined in the
    module the reference names, which lies under an import root (``--path``, the current
    directory) or in Lightning itself: the import rule in ``recorders.imports``.
    """
    cls = import_class(module_class, pl.LightningModule, "module_class", libraries=_LIBRARIES)
    return cls(**hparams)


def training_step_loss(model: pl.LightningModule, batch: Any) -> torch.Tensor:
    """The loss ``training_step`` returns (a tensor, or the ``"loss"`` of a dict).

    Outside a Trainer ``self.log`` has no logger; Lightning's warning about it is silenced.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_TRAINER_LOG)
        out = model.training_step(batch, 0)
    return out["loss"] if isinstance(out, dict) else out


def module_factory_kwargs(module: pl.LightningModule) -> dict:
    """``{"module_class": "module:Class", "hparams": {...}}`` for :func:`build_module`."""
    cls = type(module)
    return {"module_class": f"{cls.__module__}:{cls.__qualname__}", "hparams": dict(module.hparams)}


class AmpAutopsyCallback(pl.Callback):
    """Record a Lightning run with a :class:`recorders.Recorder`; snapshot failing steps.

    Args:
        run_dir: where the Recorder writes ``meta.json``, ``trace/`` and ``snapshots/``.
        factory, factory_kwargs, loss_fn: as for ``Recorder``; by default
            :func:`build_module` / :func:`training_step_loss` (see the module docstring).
        **recorder_kwargs: passed to ``Recorder`` as they are (``layer_every``, ``flush_every``,
            ``max_snapshots``, ``sync_failures``, ``enabled``, ...).

    Only automatic optimization with one optimizer is supported. ``callback.recorder`` is the
    Recorder once training has started.
    """

    def __init__(self, run_dir: str | os.PathLike, *, factory=None, factory_kwargs: dict | None = None,
                 loss_fn=None, **recorder_kwargs: Any):
        self.run_dir = run_dir
        self.factory = factory
        self.factory_kwargs = factory_kwargs
        self.loss_fn = loss_fn
        self.recorder_kwargs = recorder_kwargs
        self.recorder: Recorder | None = None
        self._scaler: torch.amp.GradScaler | None = None
        self._loss: torch.Tensor | None = None
        self._in_step = False
        self._batches: list | None = None  # with accumulation: this step's micro-batches, by reference

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.recorder is not None and not self.recorder.closed:
            return
        if not pl_module.automatic_optimization or len(trainer.optimizers) != 1:
            raise ValueError("AmpAutopsyCallback supports automatic optimization with one optimizer")
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        self._scaler = scaler if scaler is not None and scaler.is_enabled() else None
        amp_dtype = _AMP_DTYPES.get(getattr(plugin, "precision", None))
        accum = max(1, int(trainer.accumulate_grad_batches or 1))
        factory, factory_kwargs, loss_fn = self.factory, self.factory_kwargs, self.loss_fn
        if factory is None:
            factory = build_module
            factory_kwargs = module_factory_kwargs(pl_module) if factory_kwargs is None else factory_kwargs
        self.recorder = Recorder(
            self.run_dir, pl_module, factory=factory, factory_kwargs=dict(factory_kwargs or {}),
            loss_fn=training_step_loss if loss_fn is None else loss_fn,
            scaler=self._scaler, amp_dtype=amp_dtype, optimizer=trainer.optimizers[0],
            **{"step_numbering": "lightning", "micro_batches": accum, **self.recorder_kwargs},
        )
        if accum > 1:
            self.recorder._update_meta(micro_batches_kept=True)  # every snapshot holds the step's N batches

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.recorder is None:
            return
        accum = trainer.accumulate_grad_batches
        if batch_idx % accum != 0:
            if self._in_step and self._batches is not None:
                self._batches.append(batch)  # a later micro-batch of the step: a reference, no copy
            return
        self._batches = [batch] if accum > 1 else None
        self.recorder.begin_step(trainer.global_step, batch if self._batches is None else self._batches)
        micro = getattr(self.recorder, "_micro", None)  # None: a disabled Recorder
        if self._batches is not None and micro is not None:
            micro.declare("mean", float(accum), "lightning")  # Lightning divides each loss by N
        self._in_step = True
        self._loss = None

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        if not self._in_step:
            return
        loss = loss.detach()
        if self._scaler is not None and self._scaler._scale is not None:
            # The plugin scaled the loss before this hook. Dividing by the scale tensor keeps it on
            # the device (no host sync); NaN/Inf stay NaN/Inf.
            loss = loss / self._scaler._scale.to(loss.device)
        # Lightning divided each micro-batch's loss by accumulate_grad_batches: their sum is the
        # step's mean loss (one micro-batch: its loss as it is)
        self._loss = loss if self._loss is None else self._loss + loss

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.recorder is not None and self._in_step:
            self._in_step = False
            self.recorder.end_step(self._loss)
            self._loss = None
            self._batches = None

    def on_train_end(self, trainer, pl_module) -> None:
        self.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.record_exception(exception)

    def record_exception(self, exception: BaseException) -> None:
        """Keep the step `exception` interrupted, then close (``Recorder.__exit__``'s record).

        Raised inside a step (``training_step``, backward, a NaN check), the step gets an ``exception``
        snapshot of its pre-step state and batch, and a trace row with the loss if backward was reached;
        meta.json records the exception in any case. Never raises: Lightning re-raises `exception` itself.
        """
        loss, self._loss = (self._loss if self._in_step else None), None
        self._in_step = False
        if self.recorder is not None:
            record_exception(self.recorder, exception, loss=loss)
        self.close()

    def close(self) -> None:
        """Close the Recorder (flushes the trace). Safe to call twice."""
        if self.recorder is not None:
            self.recorder.close()

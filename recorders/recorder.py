"""The Recorder a training loop touches: begin_step / end_step / snapshot / close.

It records a per-step AMP trace (loss, scale, skipped steps, gradient and parameter norms per
layer) into ``RUN_DIR/trace`` and snapshots failing steps into ``RUN_DIR/snapshots`` so that
``analyzer replay`` can re-run them offline. The on-disk format is ``recorders.schema``.
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import triggers as _triggers
from ._buffers import BufferTracker
from .compiled import clean_name, compile_info, unwrap
from ._exception import record_exception
from ._fp8_watch import Fp8Watch
from ._ddp import DdpWatch
from ._fsdp import FsdpSnapshots, fsdp_meta
from ._lifecycle import Lifecycle, RecorderWarning, _atexit_close
from ._meta import RecorderConfig, amp_dtype_of, current_cwd, dist_info
from .micro_batches import MicroBatches
from ._mistakes import MistakeWatch
from ._stats import StepStats, local_tensor
from .refs import to_ref
from ._sample import UpdateSample
from ._rewind import rewind_steps, rewind_window
from ._snapshotting import Snapshotting
from .trace import LayerBuffer, TraceWriter

__all__ = ["Recorder", "RecorderWarning"]

# torch built with CUDA (or ROCm): only then can a step's CUDA generators need capturing
_CUDA_BUILT = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None


class Recorder(Snapshotting, FsdpSnapshots, StepStats, Lifecycle):
    """Records a mixed-precision training run: a per-step trace and snapshots of failing steps.

    Args:
        run_dir: directory of the run (created if missing).
        model: the ``nn.Module`` being trained.
        factory: ``"pkg.mod:build"`` or a top-level function; ``build(**factory_kwargs)``
            rebuilds the model offline. None: replay will need ``--factory``.
        factory_kwargs: JSON-serialisable keyword arguments of `factory`.
        loss_fn: ``"pkg.mod:loss"`` or a top-level function ``loss(model, batch) -> scalar``.
        scaler: the ``torch.amp.GradScaler`` scaling the loss, or None.
        amp_dtype: ``torch.float16``, ``torch.bfloat16``, or None for FP32.
        optimizer: optional; its first param group gives the ``lr`` column, and it tells
            whether ``scaler.unscale_(optimizer)`` already ran before ``end_step``.
        layer_every: record per-parameter rows every N steps (failing steps always).
        flush_every: write a trace part every N steps (also on failure and on close).
        min_scale: snapshot when the loss scale falls below this.
        overflow_streak: snapshot when this many consecutive steps overflow (are skipped).
        max_snapshots: at most this many automatic snapshots per run and rank (spikes apart).
        strict: raise the recorder's own write errors instead of warning once.
        enabled: False makes every method a no-op, so scripts need no ``if`` blocks.
        sync_failures: under torch.distributed, all-reduce a failure flag every step so that
            every rank snapshots the step any rank failed at (one extra tiny collective per step).
            NB: a collective: every rank must record (no ``enabled=(rank == 0)``) and call
            ``end_step`` on every step, or the others wait forever.
        check_update: with `optimizer`, check right after every optimizer step (its step post
            hook) whether a parameter became non-finite; the first step that made one so is
            snapshotted at once (reason ``"update"``, before ``zero_grad``: its gradients, the
            optimizer state and the post-update weights). Costs one fused norm over the weights
            and one more small host sync per optimizer step.
        step_numbering: whose numbering the ``step`` passed to ``begin_step`` follows, written to
            meta.json (``schema.STEP_NUMBERINGS``): ``"loop"`` (yours), or ``"hf_trainer"`` /
            ``"lightning"`` as the framework callbacks set it.
        micro_batches: with gradient accumulation, the number of forwards (micro-batches) whose
            gradients one step sums, written to meta.json. Pass the list of the step's
            micro-batches to ``begin_step`` and replay re-runs them all (each loss divided by their
            number, as ``loss / N`` before each backward); a single batch is the first of them
            only, which the report takes into account. None: not declared.
        loss_spike, grad_spike: snapshot (reasons ``"loss_spike"``, ``"grad_spike"``) the first step of a
            loss / total gradient norm at least this many times the median of the last `spike_window`
            steps' values and 7 robust standard deviations of their step-to-step noise above it (logs); None: off.
            Spikes are no failure (``end_step`` returns None for them), read only the values the step
            already brought to the host, and fire once the baseline holds half a window (docs/recorder.md).
        spike_window: trailing steps of the spike baselines, >= 10.
        max_spike_snapshots: at most this many spike snapshots per run and rank, apart from `max_snapshots`.
        rewind: K: host copies of weights and optimizer state every K steps and of each step's batch (cloned) and RNG,
            for ``replay SNAPSHOT --steps K``; no host sync; memory 2x (weights + optimizer state) + 2K batches.
        fp8_every: FP8 modules (torchao): their input, weight and grad_output casts measured every N steps (None:
            never); a cast flushing or saturating past the limits is an ``"fp8"`` snapshot, no failure (docs/fp8.md).

    Call ``end_step`` after ``backward`` and before ``scaler.step`` / ``optimizer.step``:
    the gradients are final and the weights are still those the failing forward used.

    Example:
        >>> rec = Recorder("runs/demo", model, factory="mypkg.models:build_mlp",  # doctest: +SKIP
        ...                factory_kwargs={"width": 64}, loss_fn="mypkg.models:mse_loss",
        ...                scaler=scaler, amp_dtype=torch.float16, optimizer=opt)
        >>> with rec:  # doctest: +SKIP
        ...     for step, batch in enumerate(loader):
        ...         rec.begin_step(step, batch)
        ...         with torch.autocast("cpu", dtype=torch.float16):
        ...             loss = mse_loss(model, batch)
        ...         scaler.scale(loss).backward()
        ...         rec.end_step(loss)
        ...         scaler.step(opt); scaler.update(); opt.zero_grad()
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        model: torch.nn.Module,
        *,
        factory: str | Callable | None = None,
        factory_kwargs: dict | None = None,
        loss_fn: str | Callable | None = None,
        scaler: torch.amp.GradScaler | None = None,
        amp_dtype: torch.dtype | str | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        layer_every: int = 1,
        flush_every: int = 50,
        min_scale: float = 1.0,
        overflow_streak: int = 8,
        max_snapshots: int = 3,
        strict: bool = False,
        enabled: bool = True,
        sync_failures: bool = False,
        check_update: bool = False,
        step_numbering: str = "loop",
        micro_batches: int | None = None,
        loss_spike: float | None = 3.0,
        grad_spike: float | None = 10.0,
        spike_window: int = 100,
        max_spike_snapshots: int = 2,
        rewind: int | None = None,
        fp8_every: int | None = 10,
    ):
        self.enabled = bool(enabled)
        self.run_dir = Path(run_dir)
        self.snapshots: list[Path] = []
        self.closed = False
        self.stopped = False  # an internal error stopped recording; training went on
        self.write_errors = 0
        self.writer = 0  # >0: another live process already records this rank here (see _claim)
        self.rank, self.world_size = dist_info()
        self.optimizer = optimizer
        if not self.enabled:
            return
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
        factory_kwargs = {} if factory_kwargs is None else factory_kwargs
        if not isinstance(factory_kwargs, dict):
            raise TypeError(f"factory_kwargs must be a dict, got {type(factory_kwargs).__name__}")
        try:
            json.dumps(factory_kwargs, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"factory_kwargs must be JSON-serialisable (the analyzer rebuilds the model "
                             f"from meta.json): {e}") from e
        self.config = RecorderConfig(layer_every, flush_every, min_scale, overflow_streak, max_snapshots,
                                     step_numbering, micro_batches, loss_spike, grad_spike, spike_window,
                                     max_spike_snapshots, fp8_every)
        self.compile = compile_info(model)  # how the loop compiled it, before unwrapping
        self.model = model = unwrap(model)  # NB: torch.compile's OptimizedModule: record the original's names
        self.factory = None if factory is None else to_ref(factory, "factory")
        self.loss_fn = None if loss_fn is None else to_ref(loss_fn, "loss_fn")
        self.factory_kwargs = dict(factory_kwargs)
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.amp_dtype = amp_dtype_of(amp_dtype)
        self.strict = bool(strict)
        self.sync_failures = bool(sync_failures)
        if check_update and optimizer is None:
            raise ValueError("check_update=True needs the optimizer: Recorder(..., optimizer=opt, check_update=True)")
        self.check_update = bool(check_update)
        self._rewind_k = rewind_steps(rewind, optimizer)
        self._hook = None  # the optimizer step post hook's handle (check_update)

        self._warned = False
        self._stop_warned = False
        self._rows: list[dict] = []
        self._layers: LayerBuffer | None = None
        self._writer: TraceWriter | None = None
        self._step: int | None = None
        self._batch: Any = None
        self._micro = MicroBatches(self.config.micro_batches)  # a list of micro-batches, recognised when written
        self._rng: dict | None = None
        self._last: dict | None = None  # the current step's row, once end_step ran
        self._failing = False
        self._peer_failing = False
        self._index_cache: tuple[tuple, torch.Tensor | None] = ((), None)
        self._atexit = functools.partial(_atexit_close, weakref.ref(self))
        atexit.register(self._atexit)
        try:
            self._setup(model)
            self._start()
        except Exception as e:  # noqa: BLE001 - the recorder must never take training down
            self._stop("start (create the run directory and write meta.json)", e)

    # ------------------------------------------------------------------ public API
    # NB: the public methods raise only for misuse of the API (steps out of order, a loss that
    # is not a scalar). Any other exception inside the recorder is caught by _stop (_lifecycle):
    # one warning, recording stops, training goes on with its numerics untouched.
    def begin_step(self, step: int, batch: Any = None) -> None:
        """Start step `step`: remember the batch (by reference) and capture the RNG state.

        Call it right before the forward pass, after anything else that draws random numbers,
        so that the captured RNG state is the one dropout will use. Buffers that forwards
        mutate in place (BatchNorm running statistics) are copied on the device here, so a
        snapshot of this step holds their pre-forward values.
        """
        if not self._live():
            return
        try:
            self._watch.begin(int(step), self._step if self._step is not None and self._last is None else None)
            self._fp8.begin(int(step))  # hooks on the FP8 modules on every fp8_every-th step only
            self._step = int(step)
            self._batch = batch
            self._micro.begin()
            self._last = None
            # NB: no device sync: a CUDA generator's state is its seed and offset, kept on the host
            cuda = torch.cuda.get_rng_state_all() if _CUDA_BUILT and torch.cuda.is_initialized() else None
            # NB: a clone of the CPU generator (its state as a tensor only if a snapshot is written):
            # half the cost of get_rng_state() here, where the step has left every cache cold
            self._rng = {"cpu": torch.default_generator.clone_state(), "cuda": cuda}
            self._buffers.begin()
            if self._rewind is not None:
                self._rewind.begin(self._step, batch, self._rng)
        except Exception as e:  # noqa: BLE001 - the recorder must never take training down
            self._stop("begin_step", e)

    def end_step(self, loss: torch.Tensor | float | None = None) -> str | None:
        """Record the step whose backward just ran; snapshot it if it failed.

        Args:
            loss: the unscaled loss (a scalar tensor or a float), or None if unknown.

        Returns:
            The reason this step is a failure (``"nonfinite_loss"``, ``"nonfinite_grads"``,
            ``"scale_collapse"``, ``"overflow_streak"``, ``"peer_failure"``) or None if healthy
            (or if recording stopped).
            A failure is snapshotted when its condition starts (edge-triggered) and the
            ``max_snapshots`` limit allows.
        """
        if not self._live():
            return None
        if self._step is None:
            raise RuntimeError("end_step() without begin_step(): call rec.begin_step(step, batch) "
                               "before the forward pass of every step")
        if self._last is not None:
            raise RuntimeError(f"end_step() called twice for step {self._step}: call "
                               "rec.begin_step(step, batch) at the start of every step")
        if isinstance(loss, torch.Tensor) and loss.numel() != 1:
            raise ValueError(f"end_step(loss) expects a scalar loss, got shape {tuple(loss.shape)}")
        try:
            failure = self._end_step(loss)
            if self._rewind is not None:
                self._rewind.end(self._last)
            self._watch.end(self._step, loss, self._last)  # misuse: a scaled loss, autocast not active
            return failure
        except Exception as e:  # noqa: BLE001 - the recorder must never take training down
            self._stop("end_step", e)
            return None

    def snapshot(self, reason: str = _triggers.MANUAL) -> Path | None:
        """Force a snapshot of the current step (call it before ``optimizer.step``).

        Manual snapshots do not count towards ``max_snapshots``. Returns the file written, or
        None if writing failed (after a warning) or the recorder is disabled or stopped.
        """
        if not self._live():
            return None
        if self._step is None:
            raise RuntimeError("snapshot() needs a current step: call rec.begin_step(step, batch) first")
        self._watch.manual = True  # snapshots without end_step are a use of their own, no misuse
        try:
            return self._snapshot(reason)
        except Exception as e:  # noqa: BLE001 - the recorder must never take training down
            self._stop("snapshot", e)
            return None

    def flush(self) -> None:
        """Write the buffered steps as one trace part (parts are atomic: all or nothing)."""
        if not self.enabled or self.closed or self.stopped:
            return
        try:
            self._flush()
        except Exception as e:  # noqa: BLE001 - the recorder must never take training down
            self._stop("flush", e)

    def close(self) -> None:
        """Flush the trace and release everything. Idempotent; called by ``with`` on exit."""
        if not self.enabled or self.closed:
            return
        try:
            if not self.stopped:  # a begin_step never ended; meta.json's steps_begun
                self._guard("update meta.json", self._watch.close)
            self.flush()
        finally:
            self.closed = True
            self._release()

    @property
    def last(self) -> dict | None:
        """The current step's trace row (``schema.STEP_COLUMNS``) once end_step ran, else None."""
        if not self.enabled or self.stopped or self._last is None:
            return None
        return dict(self._last)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Close; when the block raised, first keep the step it raised in (``recorders._exception``).

        The exception always propagates as it is: the recorder's own errors here only warn.
        """
        if exc_type is None:
            self.close()
        else:
            record_exception(self, exc if exc is not None else exc_type())

    # ------------------------------------------------------------------ step and flush
    def _end_step(self, loss) -> str | None:
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # NB: torch.no_grad() costs ~20 us more per step, cache-cold
        try:
            row, failure, snap_reason = self._record(loss)
        finally:
            torch._C._set_grad_enabled(grad_mode)
        self._rows.append(row)
        self._last = row
        if snap_reason is not None:
            # (a peer's failure under sync_failures renames the step's snapshot: then no spike evidence)
            self._snapshot(snap_reason, spike=self._triggers.spike if snap_reason in _triggers.SPIKE_REASONS else None)
        self._buffers.end()
        # Failures reach the disk at once (the process may die next), but only when they start:
        # a run that stays NaN must not write one part per step.
        failure_starts = failure is not None and not self._failing
        self._failing = failure is not None
        if snap_reason is not None or failure_starts or len(self._rows) >= self.config.flush_every:
            self._flush()
        return failure

    def _flush(self) -> None:
        if not self._rows and not (self._layers is not None and len(self._layers)):
            return
        rows, self._rows = self._rows, []
        layers = self._layers.drain(self.rank) if len(self._layers) else None
        # NB: rows that fail to write are dropped, not retried: memory stays bounded on a full disk.
        self._guard("write a trace part", self._write_trace, rows, layers)

    # ------------------------------------------------------------------ cold path and I/O
    def _setup(self, model: torch.nn.Module) -> None:
        """The device-side state: parameter list, buffers to copy, trigger state, the layer buffer."""
        self._params = list(model.parameters())  # the order of meta.json["params"]
        devices = {p.device for p in self._params}
        self._device = self._params[0].device if self._params else torch.device("cpu")
        self._single_device = len(devices) <= 1
        # the step's values are read one by one, without a stack, when every one is on the CPU
        self._host_reads = devices <= {torch.device("cpu")}
        # one _foreach_norm of the gradients (a gradient has its parameter's dtype and device)
        self._fused_norms = self._single_device and all(p.dtype != torch.float64 for p in self._params)
        self.device_type = self._device.type
        # float64 keeps counts and sums of squares exact; MPS has no float64
        self._acc = torch.float32 if self._device.type == "mps" else torch.float64
        # NB: a sharded (FSDP2 DTensor) parameter's statistics are those of this rank's shard
        self._sharded = any(callable(getattr(p, "to_local", None)) for p in self._params)
        self._fsdp = fsdp_meta(model, self._params, self.world_size) if self._sharded else None
        self._dcp_ok = False  # this step's snapshot may be collective (every rank agreed to take it)
        self._dcp_reason: str | None = None  # the reason every rank names the DCP directory after
        self._numel = torch.tensor([local_tensor(p).numel() for p in self._params], dtype=self._acc,
                                   device=self._device)
        self._buffers = BufferTracker(model)
        self._watch = MistakeWatch(model, amp_dtype=self.amp_dtype, device_type=self.device_type, scaler=self.scaler,
                                   warn=self._misuse_warning, update_meta=self._update_meta, sharded=self._sharded)
        self._cwd = current_cwd()
        self._triggers = _triggers.Triggers(self.config.min_scale, self.config.overflow_streak,
                                            self.config.max_snapshots, spikes=_triggers.spike_watch(self.config),
                                            max_spike_snapshots=self.config.max_spike_snapshots)
        self._layers = LayerBuffer(self.config.flush_every, len(self._params), self._device)
        self._update_sample = UpdateSample(self._params, self._device)
        self._fp8 = Fp8Watch(model, self.config.fp8_every, self._device)
        # DDP's gradient all-reduce: the wrapper given, or found in the first forward (meta.json rewritten then)
        self._ddp = DdpWatch(model, lambda kind, msg: self._recorder_warning(kind, msg, stacklevel=5),
                             lambda entry: self._update_meta(ddp=entry))
        self._param_names = {id(p): clean_name(n) for n, p in model.named_parameters()}
        self._rewind = rewind_window(self, model)
        if self.check_update:
            self._setup_update_check()

    def _write_trace(self, rows, layers) -> None:
        self._writer.write(rows, layers, self._fp8.drain())

"""Precision runs: rebuild the model from a snapshot and replay its step under the op recorder.

One ``run_once`` call = fresh model, recorded RNG restored, ``loss_fn(model, batch)`` under
autocast (or not, for FP32), then ``(loss * scale).backward()``. Everything the dispatch mode
measured comes back to the host in one sync at the end (``RunTrace``).
"""
from __future__ import annotations

import gc
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import AnalyzerError, BadInputError, FactoryError
from ...load.refs import missing_extra
from ._accumulate import micro_parts, scaled_loss, step_loss
from ._attribution import _ForwardTagMode, attach_module_hooks
from ._compiled import fit_state, original_module
from ._mode import _OpStatsMode
from ._precision import PrecisionMode, cast_batch, cast_model, io_hooks
from ._writes import BufferReads
from ..fp8.casts import CastWatch
from ..detection.backends import record_calls, sdpa_switches
from ..result.trace import LOW_PRECISION, RunTrace
from ._tree import map_tensors

__all__ = ["ReplayContext", "run_once", "RunTrace", "LOW_PRECISION", "OpRaised"]  # RunTrace, LOW_PRECISION: from .trace


class OpRaised(FactoryError):
    """An op of the replayed step raised (the model code's error, one line, as any ``FactoryError``).

    ``trace`` is the run up to that op, whose last record is the op; ``error`` is the exception's type and
    first line; ``numbers`` are the Python numbers the op was given (a constant it could not cast).
    """

    def __init__(self, message: str, *, path, fix: str, trace: RunTrace, error: str, numbers: list[float]):
        super().__init__(message, path=path, fix=fix)
        self.trace, self.error, self.numbers = trace, error, numbers

@dataclass
class ReplayContext:
    """Everything needed to rebuild and re-run the snapshot's step."""

    path: str
    factory: Callable
    factory_ref: str
    factory_kwargs: dict
    loss_fn: Callable
    loss_ref: str
    model_state: dict
    batch: Any
    rng: dict
    train_mode: bool
    device: torch.device
    emulate_cuda: bool
    sdpa: dict | None = None  # the snapshot's SDPA switches (recorders/_sdpa.py); None: the process's
    mode: PrecisionMode = field(default_factory=PrecisionMode)  # how low precision is replayed
    micro: dict | None = None  # the snapshot's micro_batches (format 6): batch is then their list
    # applied to the factory's model before the weights load: the FP8 recipe (fp8/recipe.py), or its plain twin
    convert: Callable[[torch.nn.Module], torch.nn.Module] | None = None
    fp8_recipe: dict | None = None  # the FP8 recipe training ran (fp8/recipe.py); None: no FP8 run
    # The FP32 run of the step with its gradients (``RunTrace.grads``), kept with the live model for the
    # fixes of a ``precision_error`` (judged on every gradient, ``_reference.judge``); results hold none.
    fp32_reference: RunTrace | None = field(default=None, repr=False)
    _model: torch.nn.Module | None = field(default=None, repr=False)

    def build_model(self, precision: str | None = None) -> torch.nn.Module:
        """The model with the snapshot's weights, gradients cleared, in the recorded mode.

        Built once per replay; later runs reload the weights and buffers into the same model
        (``load_state_dict``), which is much cheaper than rebuilding it and touching fresh memory.
        NB: non-persistent buffers that a forward mutates in place are not reset between runs.
        `precision` sets the parameters' dtypes for that run in the ``parameters`` and
        ``fsdp_param_dtype`` modes (``_precision.cast_model``); None keeps the recorded ones.
        """
        if self._model is None:
            self._model = self._build(precision)
        else:
            cast_model(self._model, self.mode, precision, self.model_state)
            self._load(self._model)
            for p in self._model.parameters():
                p.grad = None
        self._model.train(self.train_mode)
        return self._model

    def _build(self, precision: str | None = None) -> torch.nn.Module:
        model = self.make()
        model = self.convert(model) if self.convert is not None else model
        self.model_state = fit_state(model, self.model_state)  # names with or without _orig_mod. segments
        cast_model(model, self.mode, precision, self.model_state)
        self._load(model)
        return model.to(self.device)

    def make(self) -> torch.nn.Module:
        """A fresh model from the factory, its weights as the factory left them (a factory's error: one line)."""
        try:
            model = self.factory(**self.factory_kwargs)
        except Exception as e:  # noqa: BLE001 - user code failing is reported, not crashed on
            raise FactoryError(
                f"factory {self.factory_ref!r} raised {type(e).__name__}: {_first_line(e)}",
                path=self.path, fix=missing_extra(e) or "pass a working factory with --factory pkg.module:function",
            ) from e
        if not isinstance(model, torch.nn.Module):
            raise FactoryError(
                f"factory {self.factory_ref!r} returned {type(model).__name__}, not an nn.Module",
                path=self.path, fix="pass --factory pkg.module:function returning the model",
            )
        return original_module(model)  # a factory returning torch.compile(model): replay its original

    def _load(self, model: torch.nn.Module) -> None:
        try:
            model.load_state_dict(self.model_state, strict=True)
        except (RuntimeError, KeyError, TypeError) as e:
            raise BadInputError(
                f"snapshot weights do not fit the model built by {self.factory_ref!r}: {_state_dict_mismatch(e)}",
                path=self.path, fix="pass the factory that built this model with --factory",
            ) from e

    def stats_mode(self, **kwargs: Any) -> _OpStatsMode:
        """The dispatch mode that records one run (a sharded replay waits on each collective in it)."""
        return _OpStatsMode(**kwargs)

    def before_micro_batch(self, model: torch.nn.Module, last: bool) -> None:
        """Called before each micro-batch's forward (one call, `last`, without accumulation): nothing here."""

    def finish_run(self, trace: RunTrace) -> RunTrace:
        """The trace ``run_once`` returns for the run it just made: this one (a distributed replay's
        ranks in lockstep return the culprit rank's, ``distributed.lockstep``)."""
        return trace

    def grads(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The gradients the run's statistics read, by parameter name: this process's own (a sharded model's
        local shards)."""
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None and p.grad.numel() > 0}

    def restore_rng(self) -> None:
        torch.set_rng_state(self.rng["cpu"])
        cuda = self.rng.get("cuda")
        if self.device.type == "cuda" and cuda and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def _state_dict_mismatch(e: BaseException) -> str:
    """The first line that names a key: torch's first line ("Error(s) in loading state_dict for
    Net:") names none; the next says which keys are missing, unexpected or mis-shaped."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    if len(lines) > 1 and lines[0].startswith("Error(s) in loading state_dict"):
        return lines[1][:300]
    return _first_line(e)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _to_device(obj, device):
    return map_tensors(obj, lambda t: t.to(device))


def run_once(ctx: ReplayContext, precision: str, scale: float, *, zeros: bool = False,
             capture: int | None = None, on_ops=None, watch: list[str] | None = None,
             sdpa_backend: str | None = None,
             prepare: Callable[[torch.nn.Module], AbstractContextManager] | None = None,
             op_override: dict[int, Callable] | None = None, casts: CastWatch | None = None) -> RunTrace:
    """Replay the step once in `precision` with backward from ``loss * scale``.

    `watch` names buffers whose values are followed through the run (``RunTrace.buffers_read``).
    The snapshot's SDPA switches apply (``ctx.sdpa``), or only backend `sdpa_backend`
    (``"math"``, ``"flash"``...) when given (``backends.try_backends``).
    `prepare` and `op_override` are the hooks of a counterfactual fix (``replay.fixes``):
    ``prepare(model)`` returns a context manager entered around forward and backward, inside the
    recording modes (module hooks it registers, a function mode it pushes); `op_override` maps
    an op index to ``fn(func, args, kwargs)`` run instead of that op (``_OpStatsMode``).
    `casts` follows the step's FP8 casts (``fp8.casts.CastWatch``; read with its ``finalize()``).
    """
    model = ctx.build_model(precision)
    batch = cast_batch(_to_device(ctx.batch, ctx.device), ctx.mode, precision)
    ctx.restore_rng()
    reads = None
    if watch:
        named = dict(model.named_buffers())
        reads = BufferReads({n: named[n] for n in watch if n in named})
    mode = ctx.stats_mode(zeros=zeros, capture=capture, on_ops=on_ops, reads=reads, override=op_override, casts=casts)
    sdpa_ctx = sdpa_switches(ctx.sdpa, only=sdpa_backend, device=ctx.device.type)
    sdpa_calls = record_calls(mode)
    tag_mode = _ForwardTagMode(mode, emulate_cuda=ctx.emulate_cuda and precision in LOW_PRECISION)
    handles = attach_module_hooks(model, mode.module_stack) + io_hooks(model, ctx.mode, precision)
    low = precision in LOW_PRECISION
    autocast = low and ctx.mode.autocast  # parameter modes compute in the parameters' dtype
    # NB: the recorder makes ~10 small Python objects per op; a full GC pass in the middle of a
    # run costs more than the run's own bookkeeping, so collection waits until the run is over.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    losses, producers, starts = [], [], []
    try:
        with sdpa_ctx, sdpa_calls, tag_mode, mode, (prepare(model) if prepare is not None else nullcontext()):
            parts = micro_parts(ctx.micro, batch)  # one part unless the step accumulated
            for k, (part, divisor) in enumerate(parts):
                ctx.before_micro_batch(model, last=k == len(parts) - 1)
                starts.append(len(mode.records))
                with torch.autocast(ctx.device.type, dtype=getattr(torch, precision), enabled=autocast):
                    try:
                        loss = ctx.loss_fn(model, part)
                    except AnalyzerError:
                        raise
                    except Exception as e:  # noqa: BLE001 - user code failing is reported
                        msg = f"loss_fn {ctx.loss_ref!r} raised {type(e).__name__}: {_first_line(e)}"
                        fix = "check the model code, or pass --loss-fn pkg.module:function"
                        if mode.raised is not None:  # inside an op: the run up to it is evidence
                            raise _InOp(msg, fix) from e
                        raise FactoryError(msg, path=ctx.path, fix=fix) from e
                _check_loss(ctx, loss)
                if reads is not None:
                    reads.finish(loss)
                losses.append(loss)
                producers.append(mode.producer_of(loss))
                backward_ran = loss.requires_grad
                if backward_ran:
                    _backward(ctx, mode, loss, scale, divisor)
    except _InOp as r:  # the modes are left: the run up to the op that raised is read now
        raise _op_raised(ctx, mode, precision, scale, r.msg, r.fix) from r.__cause__
    finally:
        for h in handles:
            h.remove()
        if gc_was_enabled:
            gc.enable()
    named = ctx.grads(model)
    grads = list(named.values())
    grad_stats = [mode.add_stat(g) for g in grads]
    absmax, nonzero = mode.finalize()  # NB: the run's one host sync
    grad_vals = [absmax[i] for i in grad_stats]
    values = [float(x.detach().float().item()) for x in losses]  # NB: sync (after finalize, no extra wait)
    loss_value = step_loss(ctx.micro, values)
    # the loss the step's failure shows in: the first non-finite micro-batch loss, else the last
    loss_producer = next((p for v, p in zip(values, producers) if not math.isfinite(v)), producers[-1])
    return ctx.finish_run(RunTrace(
        precision=precision, scale=scale, records=mode.records, absmax=absmax, nonzero=nonzero,
        loss=loss_value,
        loss_dtype=str(loss.dtype).removeprefix("torch."),
        loss_producer=None if loss_producer is None else loss_producer[0],
        grads_finite=all(math.isfinite(v) for v in grad_vals),
        grad_absmax=_nan_max(grad_vals) / scale if grad_vals else None, backward_ran=backward_ran,
        emulated_cuda_ops=tag_mode.emulated, captured=mode.captured,
        buffers_read=None if reads is None else set(reads.read), sdpa_calls=sdpa_calls.calls,
        micro_starts=None if ctx.micro is None else starts, grads=named,
    ))


class _InOp(Exception):
    """An op raised inside the recording modes; ``run_once`` makes it an ``OpRaised`` once they are left."""

    def __init__(self, msg: str, fix: str):
        super().__init__(msg)
        self.msg, self.fix = msg, fix


def _backward(ctx: ReplayContext, mode: _OpStatsMode, loss: torch.Tensor, scale: float,
              divisor: float | None) -> None:
    """``(loss * scale).backward()``; a micro-batch's loss is first divided by `divisor`, as training did."""
    mode.module_stack.append("<loss_scale>")
    try:
        scaled_loss(loss, scale, divisor).backward()
    except RuntimeError as e:  # e.g. a custom autograd.Function failing in backward
        msg, fix = f"backward of the replayed step raised RuntimeError: {_first_line(e)}", "check the model's backward code"
        if mode.raised is not None:
            raise _InOp(msg, fix) from e
        raise AnalyzerError(msg, path=ctx.path, fix=fix) from e
    finally:
        mode.module_stack.pop()


def _op_raised(ctx: ReplayContext, mode: _OpStatsMode, precision: str, scale: float, msg: str, fix: str) -> OpRaised:
    """The run up to the op that raised, as a non-finite ``RunTrace`` whose last record is that op."""
    rec, e, numbers = mode.raised
    absmax, nonzero = mode.finalize()  # NB: the run's one host sync
    trace = RunTrace(precision=precision, scale=scale, records=mode.records, absmax=absmax, nonzero=nonzero,
                     loss=math.nan, loss_dtype="-", loss_producer=None, grads_finite=False, grad_absmax=None,
                     backward_ran=rec.phase == "backward")
    return OpRaised(msg, path=ctx.path, fix=fix, trace=trace, error=f"{type(e).__name__}: {_first_line(e)}",
                    numbers=numbers)


def _nan_max(vals: list[float]) -> float:
    return math.nan if any(math.isnan(v) for v in vals) else max(vals)


def _check_loss(ctx: ReplayContext, loss) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"tensor of shape {tuple(loss.shape)}"
        raise FactoryError(
            f"loss_fn {ctx.loss_ref!r} returned a {what}, expected a scalar floating tensor",
            path=ctx.path, fix="pass --loss-fn pkg.module:function returning loss_fn(model, batch) -> scalar",
        )

"""One trajectory through the rewind window: the model trained step by step in one precision, from one state.

``run_trajectory`` loads a state into the replay's rebuilt model, rebuilds the optimizer (``_optim``) and
runs each window step as training did: the step's RNG restored, its batch (every micro-batch, each loss
divided as training divided it), ``loss * scale`` backward, the gradients unscaled, then, unless the step
is skipped, the optimizer step with the hyperparameters the step had. No dispatch mode: plain forward and
backward, one host read of the loss and gradient norm per step.

Which steps step the optimizer (``steps_optimizer``): the run's precision follows the record (the optimizer's
step pre-hook ran, or not: GradScaler skipped the step); so does FP32, except that a step GradScaler skipped
is stepped there, as an FP32 run (no loss scale, no overflow) would. A run-precision replay whose scaled
gradients are not finite where the record stepped skips too (GradScaler would have), counted in
``Trajectory.unrecorded_skips``.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from ..runs._accumulate import micro_parts, scaled_loss, step_loss
from ..runs._precision import cast_batch, io_hooks
from ..runs._runs import ReplayContext, _to_device, _check_loss, _first_line
from ..runs._tree import map_tensors
from ...errors import AnalyzerError, FactoryError
from ._optim import rebuild_optimizer, set_hyperparameters

__all__ = ["Trajectory", "run_trajectory", "steps_optimizer"]

_LOW = ("float16", "bfloat16")


@dataclass
class Trajectory:
    """What one precision's run through the window measured, per step (the window's order)."""

    precision: str
    steps: list[int]
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # unscaled, over every parameter's gradient
    stepped: list[bool | None] = field(default_factory=list)  # the optimizer stepped after it (None: not run)
    scales: list[float] = field(default_factory=list)
    unrecorded_skips: list[int] = field(default_factory=list)  # steps skipped here (non-finite) the record stepped


def steps_optimizer(s: dict, precision: str, scaler: bool) -> bool:
    """Whether the optimizer steps after window step `s` in a replay in `precision` (module docstring)."""
    stepped = s["optimizer_stepped"]
    if stepped is None:  # the last step (the snapshot's), or a record without the hook
        stepped = not s["skipped"] if s["skipped"] is not None else True
    if not stepped and precision == "float32" and scaler and s["skipped"]:
        return True  # GradScaler skipped it for an overflow in low precision; FP32 has no loss scale
    return stepped


def _scale(s: dict, precision: str, scaler: bool) -> float:
    """The loss scale of the step: the recorded one in the run's precision with a GradScaler, else 1."""
    v = s["scale"]
    if not scaler or precision == "float32" or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        return 1.0
    return float(v)


def _restore_rng(ctx: ReplayContext, rng: dict) -> None:
    torch.set_rng_state(rng["cpu"])
    cuda = rng.get("cuda")
    if ctx.device.type == "cuda" and cuda and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def _forward_backward(ctx: ReplayContext, model: torch.nn.Module, s: dict, precision: str, scale: float) -> float:
    batch = cast_batch(_to_device(s["batch"], ctx.device), ctx.mode, precision)
    autocast = precision in _LOW and ctx.mode.autocast
    values = []
    handles = io_hooks(model, ctx.mode, precision)
    try:
        for part, divisor in micro_parts(s["micro_batches"], batch):
            with torch.autocast(ctx.device.type, dtype=getattr(torch, precision), enabled=autocast):
                try:
                    loss = ctx.loss_fn(model, part)
                except Exception as e:  # noqa: BLE001 - user code failing is reported
                    raise FactoryError(f"loss_fn {ctx.loss_ref!r} raised {type(e).__name__} at window step "
                                       f"{s['step']}: {_first_line(e)}", path=ctx.path,
                                       fix="check the model code, or pass --loss-fn pkg.module:function") from e
            _check_loss(ctx, loss)
            values.append(float(loss.detach().float().item()))
            if loss.requires_grad:
                try:
                    scaled_loss(loss, scale, divisor).backward()
                except RuntimeError as e:  # e.g. a custom autograd.Function failing in backward
                    raise AnalyzerError(f"backward of window step {s['step']} raised RuntimeError: {_first_line(e)}",
                                        path=ctx.path, fix="check the model's backward code") from e
    finally:
        for h in handles:
            h.remove()
    return step_loss(s["micro_batches"], values)


def _unscaled_norm(model: torch.nn.Module, scale: float) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    if scale != 1.0:
        torch._foreach_div_(grads, scale)
    norms = torch._foreach_norm([g.float() for g in grads])
    return float(torch.linalg.vector_norm(torch.stack(norms).double()).item())


def run_trajectory(ctx: ReplayContext, state: dict, optim: dict, steps: list[dict], precision: str,
                   scaler: bool, *, update_last: bool = False,
                   observe: Callable[[torch.nn.Module, dict], ContextManager] | None = None,
                   ) -> tuple[Trajectory, dict, dict]:
    """Train `steps` in `precision` from (`state`, `optim`). Returns the trajectory and the state and
    optimizer entry after it (`update_last`: after its last step's update, for trajectories that fork there;
    else the last step's optimizer step is not run: nothing after it is replayed). `observe(model, step)`:
    a context each step's forward and backward run in (the spike probe measures the attention logits so)."""
    ctx.model_state = state
    model = ctx.build_model(precision)
    opt = rebuild_optimizer(ctx.path, optim, model)
    out = Trajectory(precision, [s["step"] for s in steps])
    for s in steps:
        _restore_rng(ctx, s["rng"])
        opt.zero_grad(set_to_none=True)
        scale = _scale(s, precision, scaler)
        with observe(model, s) if observe is not None else nullcontext():
            loss = _forward_backward(ctx, model, s, precision, scale)
        norm = _unscaled_norm(model, scale)
        last = s is steps[-1] and not update_last
        step = steps_optimizer(s, precision, scaler) and not last
        if step and scaler and precision != "float32" and not math.isfinite(norm):
            step = False
            out.unrecorded_skips.append(s["step"])
        if step:
            set_hyperparameters(opt, s["param_groups"])
            try:
                opt.step()
            except Exception as e:  # noqa: BLE001 - e.g. LBFGS, whose step needs a closure the window lacks
                raise AnalyzerError(f"the rebuilt {type(opt).__name__}.step() raised {type(e).__name__} at window "
                                    f"step {s['step']}: {_first_line(e)}", path=ctx.path,
                                    fix="replay the snapshot's step alone (without --steps)") from e
        out.losses.append(loss)
        out.grad_norms.append(norm)
        out.stepped.append(None if last else step)
        out.scales.append(scale)
    after = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return out, after, {**optim, "state_dict": _cpu(opt.state_dict())}


def _cpu(obj):
    return map_tensors(obj, lambda t: t.detach().to("cpu", copy=True))

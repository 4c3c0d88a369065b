"""The ``scaler_skip`` fix of an ``exception`` snapshot: GradScaler would have skipped the step that raised.

The commonest FP16 crash is ``clip_grad_norm_(..., error_if_nonfinite=True)`` (or an
``assert torch.isfinite(...)``) on a step whose scaled gradients overflowed: GradScaler exists to
skip exactly those steps and lower the scale, but the loop raised before ``scaler.step`` could.
The fix is checked on the step itself, from the replay's own runs:

1. the low-precision run at the recorded loss scale has non-finite gradients (GradScaler's
   ``found_inf``), and the FP32 run is finite (loss and every gradient), so the NaN/Inf exists
   only in the scaled low-precision step and FP32's own step would not have been poisoned;
2. the low-precision step is run again and handed to a real ``torch.amp.GradScaler`` at the
   recorded scale: ``unscale_``, ``clip_grad_norm_(..., error_if_nonfinite=False)``,
   ``scaler.step``, ``scaler.update``. SGD (lr 1) stands in for the optimizer, since GradScaler skips
   ``optimizer.step()`` whatever it is. Verified means: every parameter kept its pre-step value
   bit for bit, and the scale backed off.

``plans(result)`` is the one hook into ``replay.fixes.try_fixes``: the plans that apply to the result.

Real output (``tests/exception_runs.py``, FP16 at loss scale 256, a batch that overflows FP16)::

    verified fix: let GradScaler skip the step: scaler.unscale_(optimizer), then clip_grad_norm_(params,
      max_norm, error_if_nonfinite=False), then scaler.step(optimizer) skips a step whose norm is
      non-finite: checked on step 5: float16 at loss scale 256 has non-finite gradients (the forward
      overflowed: loss inf), FP32 is finite (loss 1.64e+06, largest |gradient| 2.05e+08), so its own step
      would not have been poisoned; a torch.amp.GradScaler at 256, after unscale_ and
      clip_grad_norm_(error_if_nonfinite=False) (which returned inf instead of raising), skipped
      optimizer.step(): all 4 parameters kept their pre-step values bit for bit, the scale backed off to
      128 (SGD stood in for the optimizer; the steps after are not replayed)

How to read it: "checked on step N" lists what the replay showed, in order; a ``not_tried`` line says
which condition did not hold (no GradScaler, FP32 non-finite too, finite gradients).
"""
from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from recorders import schema

from ..runs._runs import ReplayContext, run_once
from ..result.trace import LOW_PRECISION
from .registry import Fix, FixSpec, register_fix
from ..result.replay_result import ReplayResult

__all__ = ["NAME", "plans", "scaler_skip"]

NAME = "scaler_skip"
_CLIP = "is non-finite, so it cannot be clipped"  # torch.nn.utils.clip_grad_norm_(error_if_nonfinite=True)
_WITHOUT = ("without a GradScaler, clip only finite steps: norm = clip_grad_norm_(params, max_norm, "
            "error_if_nonfinite=False), and call optimizer.step() only when torch.isfinite(norm)")


def plans(result: ReplayResult) -> list:
    """The fixes of this module that apply to `result`: ``scaler_skip`` on an ``exception`` snapshot."""
    return [scaler_skip] if result.reason == schema.REASON_EXCEPTION and result.exception is not None else []


def _title(clip: bool) -> str:
    if clip:
        return ("let GradScaler skip the step: scaler.unscale_(optimizer), then clip_grad_norm_(params, max_norm, "
                "error_if_nonfinite=False), then scaler.step(optimizer) skips a step whose norm is non-finite")
    return ("let GradScaler skip the step instead of raising on its non-finite gradients: scaler.unscale_(optimizer), "
            "then scaler.step(optimizer) skips it")


def scaler_skip(ctx: ReplayContext, result: ReplayResult) -> Fix:
    """Check, on the replay, that GradScaler would have skipped the step that raised."""
    clip = _CLIP in result.exception.get("message", "")
    title = _title(clip)
    prec = result.precision_dtype or result.amp_dtype
    low = result.traces.get(prec) if prec else None
    fp32 = result.traces.get("float32")

    def not_tried(why: str) -> Fix:
        return Fix(name=NAME, title=title, status="not_tried", precision=prec, detail=why)

    if prec not in LOW_PRECISION or low is None:
        return not_tried("the run trained in FP32: no loss scaling, nothing for GradScaler to skip")
    if fp32 is None or not fp32.finite:
        return not_tried("the FP32 replay of the step is non-finite too: skipping it would hide a real numerical "
                         "bug, not a low-precision overflow")
    raised = result.culprit.get("raised") if result.culprit is not None else None
    if raised:
        return not_tried(f"the {prec} step raised inside {result.culprit['op']} ({raised['error']}): it never "
                         "reached a backward, so there are no gradients for GradScaler to skip")
    if low.grads_finite:
        return not_tried(f"the {prec} replay at loss scale {low.scale:g} has finite gradients: GradScaler would "
                         "not skip it, so the exception has another cause")
    if result.scaler_state is None:
        return not_tried(f"the run has no GradScaler, so nothing skips a step whose gradients are non-finite; "
                         f"{'add torch.amp.GradScaler (unscale_ before clipping), or ' if prec == 'float16' else ''}"
                         f"{_WITHOUT}")
    if not getattr(ctx.mode, "autocast", True):
        return not_tried("the parameters themselves are low precision: GradScaler cannot unscale FP16 gradients")
    seen: list[torch.nn.Module] = []
    run = run_once(ctx, prec, low.scale, prepare=lambda m: _keep(seen, m))
    kept, backed_off, new_scale, norm = _skip_step(seen[0], ctx.device.type, low.scale, result.scaler_state)
    why = f"the forward overflowed: loss {run.loss:g}" if not run.forward_finite else "the backward overflowed"
    first = (f"checked on step {result.step}: {prec} at loss scale {low.scale:g} has non-finite gradients ({why}), "
             f"FP32 is finite (loss {fp32.loss:.3g}, largest |gradient| {fp32.grad_absmax:.3g}), so its own step "
             "would not have been poisoned")
    n = sum(1 for _ in seen[0].parameters())
    if kept and backed_off:
        return Fix(name=NAME, title=title, status="verified", precision=prec,
                   detail=f"{first}; a torch.amp.GradScaler at {low.scale:g}, after unscale_ and clip_grad_norm_("
                          f"error_if_nonfinite=False) (which returned {norm:g} instead of raising), skipped "
                          f"optimizer.step(): all {n} parameters kept their pre-step values bit for bit, the scale "
                          f"backed off to {new_scale:g} (SGD stood in for the optimizer; the steps after are not "
                          "replayed)")
    return Fix(name=NAME, title=title, status="fails", precision=prec,
               detail=f"{first}; but a torch.amp.GradScaler at {low.scale:g} did not skip it "
                      f"(parameters unchanged: {kept}, scale now {new_scale:g})")


def _keep(seen: list, model: torch.nn.Module):
    seen.append(model)  # the replay's own model: its gradients are the step's, scaled
    return nullcontext()


def _skip_step(model: torch.nn.Module, device: str, scale: float, state: dict | None):
    """GradScaler's own step on the gradients the replay left (scaled by `scale`)."""
    state = state or {}
    kwargs = {k: state[k] for k in ("growth_factor", "backoff_factor", "growth_interval") if k in state}
    scaler = torch.amp.GradScaler(device, init_scale=scale, **kwargs)
    params = [p for p in model.parameters()]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=1.0)
    scaler.scale(torch.ones((), device=params[0].device if params else device))  # creates its scale tensor
    scaler.unscale_(opt)
    norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=False))
    scaler.step(opt)
    scaler.update()
    kept = all(torch.equal(b, p.detach()) for b, p in zip(before, params)) and \
        all(bool(torch.isfinite(b).all()) for b in before)
    new_scale = float(scaler.get_scale())
    for p in params:
        p.grad = None
    return kept, math.isfinite(new_scale) and new_scale < scale, new_scale, norm


# Tried on an ``exception`` snapshot whatever its verdict (the replay shows what the step does; the
# skip is what a GradScaler would have done with it); it does not apply to any other snapshot.
register_fix(FixSpec(
    NAME, "let GradScaler skip the step the loop raised in",
    lambda ctx, result: scaler_skip(ctx, result) if plans(result) else None,
    serves=("overflow", "underflow", "unregistered_op", "loss_scale_overflow", "numerical_bug", "kernel_specific")))

"""Real training loops that raise inside a step, recorded by the Recorder (the ``exception`` snapshots).

``clip_loop`` is the commonest crash of an FP16 run: ``clip_grad_norm_(..., error_if_nonfinite=True)``
after ``scaler.unscale_``, on a step whose gradients GradScaler would have skipped. The model is
``build_overflow`` (first layer's weights all 1000, 16 wide): the batch of 5s at `crash_step` makes
its first matmul 16 * 1000 * 5 = 80000, past FP16's 65504, while every other batch (|x| ~ 0.001)
stays far inside FP16. FP32 computes the same step finitely.

At GradScaler's default init_scale (65536) the scaled FP16 backward of this model overflows on the
first step already (its last layer's weight gradient, ~16 * 65536 * |dL/dout|): the clip then raises
at step 0, on a loss-scale overflow that the start-up back-offs are there to absorb.
"""
from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["CRASH_STEP", "CLIP_MESSAGE", "clip_loop", "clip_batches"]

CRASH_STEP = 5
CLIP_MESSAGE = "is non-finite, so it cannot be clipped"  # torch.nn.utils.clip_grad_norm_'s error


def clip_batches(steps: int, crash_step: int | None, seed: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    data = [{"x": torch.randn(4, 16, generator=g) * 1e-3, "y": torch.randn(4, 1, generator=g)} for _ in range(steps)]
    if crash_step is not None:
        data[crash_step]["x"] = torch.full((4, 16), 5.0)
    return data


def clip_loop(run_dir: Path, *, crash_step: int | None = CRASH_STEP, steps: int = 8, init_scale: float | None = 256.0,
              amp_dtype: torch.dtype | None = torch.float16, batches: list[dict] | None = None,
              keep: dict | None = None, on_start=None, before_step=None, **recorder_kwargs) -> None:
    """Train build_overflow with unscale_ + clip_grad_norm_(error_if_nonfinite=True); raises at the bad step.

    `init_scale` None: no GradScaler (the gradients are clipped as the backward left them).
    `batches` replaces the default data; `keep` receives the model and the recorder (``keep["model"]``);
    ``on_start(run_dir)`` runs once the Recorder has started, before the first step;
    ``before_step(step, run_dir)`` before each step's begin_step.
    """
    from recorders import Recorder
    from tests.recorders.models import build_overflow, mse_loss

    model = build_overflow()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if init_scale is not None else None
    with Recorder(run_dir, model, factory="tests.recorders.models:build_overflow",
                  loss_fn="tests.recorders.models:mse_loss", scaler=scaler, amp_dtype=amp_dtype, optimizer=opt,
                  **recorder_kwargs) as rec:
        if keep is not None:
            keep.update(model=model, recorder=rec, optimizer=opt)
        if on_start is not None:
            on_start(Path(run_dir))
        for step, batch in enumerate(batches if batches is not None else clip_batches(steps, crash_step)):
            if before_step is not None:
                before_step(step, Path(run_dir))
            rec.begin_step(step, batch)
            with torch.autocast("cpu", dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
                loss = mse_loss(model, batch)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
            else:
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
            rec.end_step(loss)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()

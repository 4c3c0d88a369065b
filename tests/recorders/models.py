"""Tiny real models, factories and loss functions for the recorder tests (importable by reference)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["build_mlp", "build_dropout_mlp", "build_overflow", "build_frozen_mlp", "mse_loss", "rmse_loss", "huge_loss",
           "batches", "sgd", "train"]


def build_mlp(width: int = 8, depth: int = 2, seed: int = 0) -> nn.Module:
    """A small MLP: `depth` x (Linear, LayerNorm, ReLU), then Linear to one output."""
    g = torch.Generator().manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
    layers.append(nn.Linear(width, 1))
    model = nn.Sequential(*layers)
    with torch.no_grad():  # seeded from a private generator: building draws no global RNG
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def build_dropout_mlp(width: int = 8, p: float = 0.5, seed: int = 0) -> nn.Module:
    """An MLP with dropout and a BatchNorm (buffers), for RNG and buffer round trips."""
    model = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Dropout(p),
                          nn.ReLU(), nn.Linear(width, 1))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q in model.parameters():
            q.copy_(torch.randn(q.shape, generator=g) * 0.3)
    return model


def build_overflow(width: int = 16, gain: float = 1000.0) -> nn.Module:
    """Linear layers whose FP16 matmul output exceeds 65504 once inputs are large enough.

    With all weights equal to `gain` and inputs of 1s, one output is width * gain * x: for
    width 16, gain 1000 that is 16000 * x, so x >= 4.1 overflows FP16 (max 65504).
    """
    model = nn.Sequential(nn.Linear(width, width), nn.Linear(width, 1))
    with torch.no_grad():
        model[0].weight.fill_(gain)
        model[0].bias.zero_()
        model[1].weight.fill_(1e-3)
        model[1].bias.zero_()
    return model


def mse_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]).float(), batch["y"])


def batches(n: int, width: int = 8, size: int = 4, seed: int = 1, scale: float = 1.0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(size, width, generator=g) * scale, "y": torch.randn(size, 1, generator=g)}
            for _ in range(n)]


def sgd(model: nn.Module, lr: float = 0.05) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)


def train(model, data, *, rec=None, opt=None, amp_dtype=None, scaler=None, unscale=False,
          on_step=None, loss_fn=None, lr_gamma=None, device_type="cpu") -> list[float]:
    """The reference loop of the README: begin_step, forward under autocast, backward, end_step, step.

    `on_step(step, opt)` runs right after end_step, before the optimizer step.
    """
    loss_fn = loss_fn or mse_loss
    opt = opt if opt is not None else sgd(model)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, lr_gamma) if lr_gamma else None
    losses = []
    for step, batch in enumerate(data):
        if rec is not None:
            rec.begin_step(step, batch)
        with torch.autocast(device_type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            loss = loss_fn(model, batch)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if unscale and scaler is not None:
            scaler.unscale_(opt)
        if rec is not None:
            rec.end_step(loss)
        if on_step is not None:
            on_step(step, opt)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def rmse_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """sqrt(mse): at a perfect fit the loss is 0 but d sqrt/dx at 0 is inf, times 0: NaN grads."""
    return torch.sqrt(F.mse_loss(model(batch["x"]).float(), batch["y"]))


def build_frozen_mlp(width: int = 8) -> nn.Module:
    """An MLP whose first layer is frozen: its parameters never get a gradient."""
    model = build_mlp(width=width, depth=1)
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


def huge_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Finite gradients around 1e20: each element fits float32, the sum of their squares does not."""
    return model(batch["x"]).float().sum() * 1e20

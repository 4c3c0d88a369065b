"""A tiny model without normalisation whose loss spikes for real when its lr jumps (importable by reference)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["build_plain", "plain_loss", "linear_batches", "train_with_lr_jumps"]


def build_plain(width: int = 8, hidden: int = 32, seed: int = 0) -> nn.Module:
    """Linear, Tanh, Linear: nothing normalises a weight an oversized step blew up."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def plain_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]).float(), batch["y"])


def linear_batches(n: int, width: int = 8, size: int = 16, seed: int = 1) -> list[dict]:
    """A noisy linear teacher: the loss falls to ~0.02 and stays there with batch-to-batch noise."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(width, 1, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(size, width, generator=g)
        out.append({"x": x, "y": x @ w + 0.1 * torch.randn(size, 1, generator=g)})
    return out


def train_with_lr_jumps(model, data, *, opt, rec=None, jumps=(), factor=1000.0, amp_dtype=None,
                        returned: list | None = None) -> list[float]:
    """The README loop; at each step in `jumps` the optimizer steps once at `factor` x its lr
    (an lr scheduler bug for one step; Adam at lr 3e-3 then moves each weight by about 3).
    `returned` collects end_step's return values."""
    base = [g["lr"] for g in opt.param_groups]
    losses = []
    for step, batch in enumerate(data):
        if rec is not None:
            rec.begin_step(step, batch)
        with torch.autocast("cpu", dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            loss = plain_loss(model, batch)
        loss.backward()
        if rec is not None:
            r = rec.end_step(loss)
            if returned is not None:
                returned.append(r)
        for g, lr in zip(opt.param_groups, base):
            g["lr"] = lr * (factor if step in jumps else 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses

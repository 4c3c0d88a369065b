"""A tiny MLP that centres its hidden features over the batch, and a data shift that low precision cannot centre.

``h = lin0(x); h - h.mean(0)`` is exact in FP32 whatever offset the inputs carry. Under autocast ``lin0``'s
output is BF16/FP16: a batch shifted by ``offset`` gives features of magnitude ~offset, rounded to a spacing
of offset * 2^-8 (BF16) before the centring, which then keeps the rounding and loses the signal (a loss spike
FP32 does not have); FP16 overflows to inf at offsets past ~1e4, and inf - inf is NaN.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Centered", "build_centered", "centered_loss", "shifted_batches", "train"]


class Centered(nn.Module):
    def __init__(self, width: int = 8, hidden: int = 32):
        super().__init__()
        self.lin0, self.lin1 = nn.Linear(width, hidden), nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin0(x)
        return self.lin1(torch.tanh(h - h.mean(0, keepdim=True)))


def build_centered(width: int = 8, hidden: int = 32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Centered(width, hidden)


def centered_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]).float(), batch["y"])


def shifted_batches(n: int, *, shift_at: int | None = None, offset: float = 2000.0, size: int = 32,
                    width: int = 8, seed: int = 1) -> list[dict]:
    """A noisy linear teacher of centred inputs; the batch at `shift_at` carries `offset` on every input
    (the teacher's targets do not move: the model centres the offset away, in FP32)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(width, 1, generator=g) / width ** 0.5
    out = []
    for i in range(n):
        x = torch.randn(size, width, generator=g)
        y = (x - x.mean(0)) @ w + 0.03 * torch.randn(size, 1, generator=g)
        out.append({"x": x + offset if i == shift_at else x, "y": y})
    return out


def train(model, data, *, opt, rec=None, amp_dtype=None, scaler=None, snapshot_at: int | None = None,
          reuse_buffer: bool = False) -> list[float]:
    """The README loop (GradScaler when given). `snapshot_at`: a manual snapshot after that step's end_step.
    `reuse_buffer`: the loop copies each batch into one buffer it refills in place, as some loops do."""
    losses, buf = [], None
    for step, batch in enumerate(data):
        if reuse_buffer:
            if buf is None:
                buf = {k: v.clone() for k, v in batch.items()}
            else:
                for k, v in batch.items():
                    buf[k].copy_(v)
            batch = buf
        if rec is not None:
            rec.begin_step(step, batch)
        with torch.autocast("cpu", dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            loss = centered_loss(model, batch)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if rec is not None:
            rec.end_step(loss)
            if step == snapshot_at:
                rec.snapshot()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses

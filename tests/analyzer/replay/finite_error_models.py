"""Tiny models whose low-precision step is finite and wrong, and their healthy twins, recorded for replay.

``NormNet``: a Linear whose outputs are centred on 8, then a normalisation whose variance is computed in
one pass, E[h^2] - E[h]^2: in FP16/BF16 both terms round correctly and their difference, a small number
from two large ones, keeps only their rounding. No NaN anywhere; the loss and gradients are wrong.
``two_pass=True`` computes E[(h - E[h])^2] instead: the healthy twin.
``Positions``: positions counted by ``ones.cumsum(-1)`` in the activations' dtype, then sin and cos of
position x frequency: past 256 a BF16 position is rounded (to within half an eps), and the sine of a large,
rounded angle is far from FP32's. ``fp32_positions=True`` counts in FP32: the healthy twin.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from recorders import Recorder

__all__ = ["OnePassNorm", "NormNet", "build_norm", "norm_loss", "norm_batch", "record_step", "VARIANCE_LINE",
           "Positions", "build_positions", "positions_batch", "SIN_LINE"]



class OnePassNorm(nn.Module):
    """A normalisation whose variance is E[x^2] - E[x]^2, in one pass (``two_pass``: E[(x - E[x])^2])."""

    def __init__(self, two_pass: bool = False):
        super().__init__()
        self.two_pass = two_pass

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mu = h.mean(-1, keepdim=True)
        var = ((h - mu) ** 2).mean(-1, keepdim=True) if self.two_pass else (h * h).mean(-1, keepdim=True) - mu * mu
        return (h - mu) / torch.sqrt(var.abs() + 1e-3)


class NormNet(nn.Module):
    """Linear -> OnePassNorm -> Linear, the first Linear's outputs centred on `mean` (its bias)."""

    def __init__(self, d: int = 16, mean: float = 8.0, two_pass: bool = False, dropout: float = 0.0):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)
        self.norm = OnePassNorm(two_pass)
        self.out = nn.Linear(d, 1)
        with torch.no_grad():
            self.inp.bias.fill_(mean)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.drop(self.inp(x))))


def build_norm(**kwargs) -> NormNet:
    torch.manual_seed(0)
    return NormNet(**kwargs)


def norm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]).float().squeeze(-1), batch["y"])


def norm_batch(d: int = 16, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(64, d, generator=g), "y": torch.randn(64, generator=g)}


def record_step(out: Path, dtype: torch.dtype, *, factory: str, loss_fn: str, batch: dict, scaler: bool = False,
                steps: int = 1, **kwargs) -> Path:
    """`steps` recorded SGD steps of ``factory(**kwargs)`` on `batch` in `dtype` under autocast, a manual
    snapshot of the last; its path. With `scaler`, a GradScaler at its default init_scale (65536): the
    first steps may overflow and back it off, as in training."""
    mod = __import__(__name__, fromlist=["_"])
    model = getattr(mod, factory)(**kwargs)
    loss_of = getattr(mod, loss_fn)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gs = torch.amp.GradScaler("cpu") if scaler else None
    with Recorder(out, model, factory=f"{__name__}:{factory}", factory_kwargs=kwargs, loss_fn=f"{__name__}:{loss_fn}",
                  amp_dtype=dtype, scaler=gs, optimizer=opt) as rec:
        for step in range(steps):
            rec.begin_step(step, batch)
            with torch.autocast("cpu", dtype=dtype):
                loss = loss_of(model, batch)
            (gs.scale(loss) if gs is not None else loss).backward()
            rec.end_step(loss)
            path = rec.snapshot() if step == steps - 1 else None
            if gs is not None:
                gs.step(opt)
                gs.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
    assert path is not None
    return path


class Positions(nn.Module):
    """Sinusoidal features of positions counted by a cumulative sum of ones in the activations' dtype."""

    def __init__(self, d: int = 8, fp32_positions: bool = False):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.out = nn.Linear(2 * d, 1)
        self.register_buffer("freq", torch.linspace(0.05, 1.0, d))
        self.fp32_positions = fp32_positions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        ones = torch.ones_like(h[..., 0], dtype=torch.float32 if self.fp32_positions else None)
        pos = ones.cumsum(-1)
        angle = pos.unsqueeze(-1) * self.freq
        return self.out(torch.cat([h * torch.sin(angle), h * torch.cos(angle)], -1))


def build_positions(**kwargs) -> Positions:
    torch.manual_seed(0)
    return Positions(**kwargs)


def positions_batch(seq: int = 600, d: int = 8, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(2, seq, d, generator=g), "y": torch.randn(2, seq, generator=g)}


def _line_of(text: str) -> int:
    """The first line of this file holding `text` (the first is the model's own line, above this)."""
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if text in line)


VARIANCE_LINE = _line_of("- mu * mu")  # the one-pass variance (its subtraction), as a replay names it
SIN_LINE = _line_of("torch.sin(angle)")  # sin(angle) in Positions.forward

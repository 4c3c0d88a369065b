"""Tiny models whose compiled and eager FP16 steps disagree about finiteness, by mechanisms that need no rounding luck.

``build_gate_net``: compiled-only NaN. ``gate.proj``'s weight is 0.9998 * I, which FP16 autocast
rounds to exactly 1 (the nearest FP16 values are 0.99951 and 1), so an input of exactly 1 gives
c = 1 * 1.0001. Eager FP16 rounds c back to 1 (the FP16 spacing above 1 is 2**-10) and
``(1 - c*c) ** 1.5`` is 0, with gradient 0. Inductor keeps c in FP32 registers: 1 - c*c = -2e-4 and
its power 1.5 is NaN. FP32 eager never rounds the weight: c = 0.99990 and the step is finite.

``build_chain_net``: eager-only overflow (docs/PYTORCH-NOTES: ``z = (h * 512) * 512 / 262144``):
eager FP16 rounds after each op, so ``h * 512 * 512`` passes 65504 for |h| > 0.25 and
``z - z.mean()`` is NaN; Inductor fuses the chain into one FP32 kernel and the step is finite.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["build_gate_net", "build_gate_stack", "build_chain_net", "mse_loss", "gate_batch", "chain_batch"]


class Gate(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.proj(x) * 1.0001
        return (1 - c * c) ** 1.5


class GateNet(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.gate = Gate(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(x))


class GateStack(nn.Module):
    """Repeated blocks (a ``ModuleList`` of one class): what accelerate's ``compile_regions`` compiles one by one."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList([Gate(width), Gate(width)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Chain(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = (h * 512) * 512 / 262144
        return z - z.mean()


class ChainNet(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.chain = Chain()
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.chain(self.fc(x)))


def _seeded(model: nn.Module, seed: int, std: float) -> nn.Module:
    g = torch.Generator().manual_seed(seed)  # building draws no global RNG
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def build_gate_net(width: int = 4) -> nn.Module:
    model = _seeded(GateNet(width), 0, 0.1)  # small: the backward at GradScaler's 65536 fits FP16
    with torch.no_grad():
        model.gate.proj.weight.copy_(torch.eye(width) * 0.9998)
    return model


def build_gate_stack(width: int = 4) -> nn.Module:
    """``build_gate_net``'s gate twice: the compiled-only NaN is born in ``blocks.0`` (``blocks.1`` sees its
    eager output, at most 1 - 0.9998**2 away from 0, and stays finite either way)."""
    model = _seeded(GateStack(width), 0, 0.1)
    with torch.no_grad():
        for block in model.blocks:
            block.proj.weight.copy_(torch.eye(width) * 0.9998)
    return model


def build_chain_net(width: int = 4) -> nn.Module:
    model = _seeded(ChainNet(width), 0, 0.5)  # |fc(x)| > 0.25: eager's second multiply passes 65504
    with torch.no_grad():
        model.head.weight.mul_(0.1)  # a small output: the backward at GradScaler's 65536 fits FP16
    return model


def mse_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]).float(), batch["y"])


def gate_batch() -> dict:
    """Entries in [-1, 1], some exactly 1: only those leave the domain, and only compiled."""
    x = torch.tensor([[1.0, 0.5, -0.25, 0.0], [0.25, 1.0, -0.5, 0.75]])
    return {"x": x, "y": torch.zeros(2, 1)}


def chain_batch() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"x": torch.randn(4, 4, generator=g) * 2, "y": torch.zeros(4, 1)}

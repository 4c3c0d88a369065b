"""A Gaussian-NLL regressor whose std head is a hand-written softplus, ``log(1 + exp(x))``.

Trained in FP16 with ``GradScaler("cpu")`` at its default ``init_scale`` (65536): the first steps
overflow while GradScaler calibrates (targets far from the initial mean make d loss / d mu large),
then, at ``FAIL_STEP``, a batch of large inputs drives the std head past ln(65504) ~ 11.09, where
FP16 ``exp`` overflows: ``log(1 + inf)`` is inf and the loss is non-finite with the scale steady.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GaussianNLL", "StdHead", "build_gnll", "gnll_loss", "gnll_batches", "FAIL_STEP"]

FAIL_STEP = 22


class StdHead(nn.Module):
    """The std head: a linear pre-activation, then a hand-written softplus."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, h):
        return torch.log(1 + torch.exp(self.proj(h)))  # exp overflows FP16 once its input passes 11.09


class GaussianNLL(nn.Module):
    def __init__(self, width: int = 16, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(4, width), nn.ReLU())
        self.mean = nn.Linear(width, 1)
        self.std = StdHead(width)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            self.std.proj.weight.abs_()  # large positive inputs give a large positive pre-activation
            self.body[0].weight.abs_()

    def forward(self, x):
        h = self.body(x)
        return self.mean(h), self.std(h)


def build_gnll(width: int = 16, seed: int = 0) -> nn.Module:
    return GaussianNLL(width, seed)


def gnll_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    mu, std = model(batch["x"])
    return F.gaussian_nll_loss(mu.float(), batch["y"], std.float() ** 2, reduction="sum")


def gnll_batches(n: int, *, fail_step: int = FAIL_STEP, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(n):
        x = torch.rand(8, 4, generator=g)
        if step == fail_step:
            x = x + 5.0  # the std head's pre-activation reaches ~19: exp(19) ~ 1.8e8 fits FP32, not FP16
        out.append({"x": x, "y": torch.randn(8, 1, generator=g) * 3 + 30.0})
    return out

"""A model whose FP16 forward raises inside an op: attention masked with the constant -1e9, which FP16
cannot hold (``value cannot be converted to type c10::Half without overflow``); FP32 and BF16 run it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

REF = "tests.analyzer.replay.raise_models"


class MaskedAttention(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, pad):
        scores = self.q(x) @ self.k(x).transpose(-2, -1)  # FP16 under autocast
        scores = scores.masked_fill(pad[:, None, :], -1e9)  # the classic large constant
        return F.softmax(scores, dim=-1) @ self.v(x)


class Net(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.attn, self.head = MaskedAttention(d), nn.Linear(d, 1)

    def forward(self, x, pad):
        return self.head(self.attn(x, pad))


def build(d: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return Net(d)


def loss_fn(model, batch):
    return F.mse_loss(model(batch["x"], batch["pad"]).float(), batch["y"])


def batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[:, -2:] = True  # the last two positions are padding
    return {"x": torch.randn(2, 6, 8, generator=g), "y": torch.randn(2, 6, 1, generator=g), "pad": pad}

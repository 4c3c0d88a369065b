"""The model of ``bench/distributed_replay_memory.py``: an MLP whose parameters dominate the replay's memory.

Top level, so that the recorder's references (``_replay_model:build``) resolve when the replay is given
``--path bench``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["build", "loss_fn"]


def build(width: int = 2048, depth: int = 4) -> nn.Module:
    """``depth`` Linear(width, width) + ReLU blocks and a Linear(width, 1) head, seeded."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]).float(), batch["y"])

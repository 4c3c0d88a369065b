"""Tiny real runs that do not learn although the trace shows a normal lr and normal gradients.

- ``unit_bug``: an AdamW subclass whose ``step`` multiplies every group's lr by 1e-5 for the
  step (a units bug in a custom optimizer) while the param groups, hence the trace's lr column and
  meta.json, keep the nominal 3e-3; or SGD whose gradients are divided by 1e5 after ``end_step``
  (a misplaced accumulation divisor). The weights move ~1e-5 of what the optimizer's rule gives.
- ``healthy``: the same loops without the bug.
- ``scaled 0.0``: the same custom optimizer at a multiplier of 0: an lr = 0 run, whose losses the
  unit bug's match.

An MLP classifier on the samples' teacher batches, FP32 (or BF16 autocast), every step a layer row.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from recorders import Recorder
from samples._common import teacher_batches

__all__ = ["ScaledAdamW", "build_classifier", "classifier_loss", "record"]

STEPS = 300


class ScaledAdamW(torch.optim.AdamW):
    """AdamW whose step uses `scale` x each group's lr (the groups keep the nominal lr)."""

    def __init__(self, params, lr: float, scale: float):
        super().__init__(params, lr=lr)
        self.scale = scale

    @torch.no_grad()
    def step(self, closure=None):
        nominal = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] = g["lr"] * self.scale
        try:
            return super().step(closure)
        finally:
            for g, lr in zip(self.param_groups, nominal):
                g["lr"] = lr


def build_classifier(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def classifier_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]).float(), batch["y"])


def record(run_dir: Path, *, opt: str = "adamw", scale: float = 1.0, grad_divisor: float = 1.0,
           amp_dtype: torch.dtype | None = None, steps: int = STEPS, seed: int = 0, layer_every: int = 1) -> list[float]:
    """Record one run; `scale` < 1 shrinks AdamW's step, `grad_divisor` > 1 SGD's gradients after end_step."""
    model = build_classifier(seed)
    o = ScaledAdamW(model.parameters(), lr=3e-3, scale=scale) if opt == "adamw" else \
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = teacher_batches(in_features=16, n_classes=4, batch_size=32, seed=seed)
    losses = []
    with Recorder(run_dir, model, optimizer=o, amp_dtype=amp_dtype, layer_every=layer_every,
                  factory="tests.analyzer.report.learning_runs:build_classifier",
                  loss_fn="tests.analyzer.report.learning_runs:classifier_loss") as rec:
        for step in range(steps):
            batch = next(data)
            rec.begin_step(step, batch)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp_dtype is not None):
                loss = classifier_loss(model, batch)
            loss.backward()
            rec.end_step(loss)
            if grad_divisor != 1.0:
                for p in model.parameters():
                    p.grad.div_(grad_divisor)
            o.step()
            o.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return losses

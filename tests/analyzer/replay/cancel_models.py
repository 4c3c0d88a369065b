"""A regressor with a hand-written batch norm whose variance is the one-pass ``E[h²] - E[h]²``.

``OnePassNorm`` computes ``var = (h * h).mean(0) - m * m``. Under BF16 autocast ``h`` comes out
of a Linear in BF16, and so do ``h * h``, both means and ``m * m``: for features near 200, ``E[h²]``
is ~4e4, where BF16's spacing is 256, while the true variance is a few units. The subtraction
cancels every significant digit, and the rounding of the two terms (which do not round alike:
``m`` is rounded before it is squared) leaves a negative variance (-256) in some features, so
``sqrt`` gives NaN. FP32 computes the same expression to ~1e-2 and stays finite. The mechanism
is the size of BF16's spacing, not which way one kernel rounds: a feature whose rounding lands
on 0 or +256 leaves the others negative.

Importable as ``tests.analyzer.replay.cancel_models:NAME``, which the recorder stores and replay
resolves. ``train`` is the plain loop; ``tests/analyzer/replay/test_cancellation.py`` also trains
``LitRegressor`` under Lightning.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from recorders import Recorder

REF = "tests.analyzer.replay.cancel_models"
FEATURES, WIDTH, BATCH = 4, 16, 32
FAIL_STEP = 5  # the batch whose features sit near 200


class OnePassNorm(nn.Module):
    """Batch norm over dim 0 with the one-pass variance ``E[h²] - E[h]²`` (no running stats)."""

    def __init__(self, width: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, h):
        m = h.mean(0)
        var = (h * h).mean(0) - m * m
        return (h - m) / torch.sqrt(var + self.eps) * self.weight + self.bias


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(FEATURES, WIDTH)
        self.norm = OnePassNorm(WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.fc(x))))


def build() -> nn.Module:
    torch.manual_seed(0)
    model = Regressor()
    with torch.no_grad():  # every feature of fc sums its inputs with a weight near 1
        model.fc.weight.uniform_(0.2, 0.3)
        model.fc.bias.zero_()
    return model


def loss(model, batch):
    """Smooth L1, as robust regressors use: it grows linearly, so a wrecked step stays finite."""
    return F.smooth_l1_loss(model(batch["x"]).float().squeeze(-1), batch["y"])


def batch_at(step: int) -> dict:
    """Unit-scale features, except at ``FAIL_STEP``: every feature near 200 (+-3)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, FEATURES, generator=g)
    if step == FAIL_STEP:
        x = 200.0 + 3.0 * x
    y = torch.randn(BATCH, generator=g) + 2.0
    return {"x": x, "y": y}


def train(run_dir: str | Path, *, steps: int = FAIL_STEP + 1) -> Path:
    """The plain BF16 loop with the real Recorder; returns the failing step's snapshot."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with Recorder(run_dir, model, factory=f"{REF}:build", loss_fn=f"{REF}:loss", amp_dtype=torch.bfloat16,
                  optimizer=opt) as rec:
        for step in range(steps):
            batch = batch_at(step)
            rec.begin_step(step, batch)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = loss(model, batch)
            out.backward()
            bad = rec.end_step(out)
            opt.step()
            opt.zero_grad()
            if bad is not None:
                break
    assert rec.snapshots, "the recorder wrote no snapshot"
    return rec.snapshots[-1]

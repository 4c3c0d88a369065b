"""Tiny real training runs whose failure is born in the optimizer update, recorded with the Recorder.

- ``fp16_embedding_run``: a pure-FP16 (``model.half()``) embedding model trained with Adam at the
  default eps=1e-8, which is 0 in float16. Step 0's batch uses rows 0-7 only, so every other row
  gets an exactly-zero gradient and the update 0/(sqrt(0)+0) = NaN; step 1's batch reads row 12,
  so its loss is NaN. param_norm (taken before each step) is NaN from step 1 on.
- ``mlp_run``: an MLP whose middle layer's weights sit near 1-2, trained with Adam at lr 1e-4: in
  BF16 the update (~lr) is below half an ulp of those weights (~0.004) and rounds away; in FP32 it
  does not.
- ``clip_run``: FP32, no GradScaler, ``clip_grad_norm_`` over a gradient that is +inf (sqrt at 0):
  the clip coefficient max_norm/(inf + 1e-6) is 0, and 0 * inf = NaN reaches Adam.
- ``sgd_overflow_run``: FP16 weights at 65000 and an SGD step of lr 6e4 x gradient 0.1 = +6000: the
  sum passes 65504.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from recorders import Recorder

__all__ = ["Emb", "MLP", "fp16_embedding_run", "mlp_run", "clip_run", "sgd_overflow_run", "snapshots"]


class Emb(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.emb(x)).float().mean()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.scale = nn.Linear(16, 16)
        self.out = nn.Linear(16, 1)
        with torch.no_grad():
            self.scale.weight.copy_(torch.eye(16) + 1.0)  # weights 1 and 2: BF16 half-ulp 2**-8 and 2**-7

    def forward(self, x):
        return self.out(torch.relu(self.scale(torch.relu(self.fc1(x)))))


class Sqrt(nn.Module):
    """A linear layer plus sqrt of a gate that starts at exactly 0: d sqrt(g)/dg = +inf there."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.gate = nn.Parameter(torch.tensor([0.0, 1.0]))

    def forward(self, x):
        return self.lin(x).pow(2).mean() + self.gate.sqrt().sum()


def _fresh(run_dir) -> Path:
    shutil.rmtree(run_dir, ignore_errors=True)
    return Path(run_dir)


def fp16_embedding_run(run_dir, *, check_update: bool = False, steps: int = 4, eps: float = 1e-8,
                       optimizer: str = "adam") -> Path:
    """``optimizer="rmsprop"``: RMSprop at eps=1e-8, also 0 in float16 (replay knows no formula for it)."""
    run_dir = _fresh(run_dir)
    torch.manual_seed(0)
    model = Emb().half()
    opt = (torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps) if optimizer == "adam"
           else torch.optim.RMSprop(model.parameters(), lr=1e-3, eps=eps))
    with Recorder(run_dir, model, optimizer=opt, check_update=check_update) as rec:
        for step in range(steps):
            x = torch.arange(8) if step == 0 else torch.tensor([1, 2, 12, 3])
            rec.begin_step(step, x)
            loss = model(x)
            loss.backward()
            rec.end_step(loss)
            opt.step()
            opt.zero_grad()
    return run_dir


def mlp_run(run_dir, dtype: torch.dtype, *, steps: int = 30, lr: float = 1e-4) -> Path:
    run_dir = _fresh(run_dir)
    torch.manual_seed(0)
    model = MLP().to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=1e-6)
    with Recorder(run_dir, model, optimizer=opt) as rec:
        for step in range(steps):
            x, y = torch.randn(16, 8, dtype=dtype), torch.randn(16, 1, dtype=dtype)
            rec.begin_step(step, (x, y))
            loss = (model(x).float() - y.float()).pow(2).mean()
            loss.backward()
            rec.end_step(loss)
            opt.step()
            opt.zero_grad()
    return run_dir


def clip_run(run_dir, *, check_update: bool = True, steps: int = 2) -> Path:
    run_dir = _fresh(run_dir)
    torch.manual_seed(0)
    model = Sqrt()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Recorder(run_dir, model, optimizer=opt, check_update=check_update) as rec:
        for step in range(steps):
            x = torch.randn(8, 4)
            rec.begin_step(step, x)
            loss = model(x)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            rec.end_step(loss)
            opt.step()
            opt.zero_grad()
    return run_dir


def sgd_overflow_run(run_dir) -> Path:
    run_dir = _fresh(run_dir)
    torch.manual_seed(0)
    model = nn.Linear(4, 1).half()
    with torch.no_grad():
        model.weight.fill_(65000.0)
    opt = torch.optim.SGD(model.parameters(), lr=6e4)
    with Recorder(run_dir, model, optimizer=opt, check_update=True) as rec:
        x = torch.full((2, 4), -0.1, dtype=torch.float16)  # output -26000: finite; dloss/dw = -0.1
        rec.begin_step(0, x)
        loss = model(x).float().mean()
        loss.backward()
        rec.end_step(loss)
        opt.step()
        opt.zero_grad()
    return run_dir


def snapshots(run_dir, reason: str | None = None) -> list[Path]:
    out = sorted((Path(run_dir) / "snapshots").glob("*.pt"))
    return [p for p in out if reason is None or p.stem.endswith("-" + reason)]

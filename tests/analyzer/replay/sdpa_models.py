"""A tiny attention model on ``F.scaled_dot_product_attention`` and a real recorded run that breaks it.

The mechanism (checked on torch 2.13 CPU, every SIMD level): with
``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)`` the math backend computes QKᵀ
in FP16 under autocast, and logits of ~1e6 overflow FP16's 65504 to inf; softmax over a row of
inf is NaN (pytorch/pytorch#119131). The CPU flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``) keeps the logits in FP32, so the same
step is finite there. Logits of ~1e6 are 15x past the limit: no rounding luck is involved.

``record_run`` trains a few steps with the Recorder, the batch of step ``FAULT_STEP`` scaled up
(a fault at a known step), and returns the run directory. Run as a script it records a run,
replays its snapshot and prints the replay's JSON (the SIMD test runs it under
``ATEN_CPU_CAPABILITY=default``).
"""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from recorders import Recorder

REF = "tests.analyzer.replay.sdpa_models"
FAULT_STEP = 3
DIM, HEADS, SEQ = 16, 2, 6


class SdpaAttention(nn.Module):
    """Causal self-attention on ``F.scaled_dot_product_attention``."""

    def __init__(self, dim: int = DIM, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def heads_of(self, x):
        b, t, c = x.shape
        return (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, -1))

    def forward(self, x):
        q, k, v = self.heads_of(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(x.shape))


class MatmulAttention(SdpaAttention):
    """The same attention written by hand (q @ kᵀ, softmax): no SDPA call at all."""

    def forward(self, x):
        q, k, v = self.heads_of(x)
        logits = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        y = logits.softmax(-1) @ v
        return self.out(y.transpose(1, 2).reshape(x.shape))


class SdpaNet(nn.Module):
    """One attention block (``attn``) and a linear head."""

    def __init__(self, matmul: bool = False):
        super().__init__()
        self.attn = (MatmulAttention if matmul else SdpaAttention)()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        return self.head(self.attn(x))


def build_sdpa(matmul: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = SdpaNet(matmul)
    with torch.no_grad():  # q = k = 2 * sum(x) = 640 at x = 20: every logit is 640^2 * 8 / sqrt(8) ~ 1.2e6
        model.attn.qkv.weight[: 2 * DIM].fill_(2.0)
        model.attn.qkv.bias[: 2 * DIM].zero_()
    return model


def sdpa_mse(model, batch):
    return F.mse_loss(model(batch["x"]).float(), batch["y"])


def batch_at(step: int) -> dict:
    """Inputs in [-0.5, 0.5]; at FAULT_STEP all ~20, which makes the logits ~1.2e6."""
    g = torch.Generator().manual_seed(step)
    x = torch.rand(2, SEQ, DIM, generator=g) - 0.5
    if step == FAULT_STEP:
        x = 20.0 + 0.1 * x
    return {"x": x, "y": torch.zeros(2, SEQ, 1)}


@contextlib.contextmanager
def sdpa_switches(backend: str | None, reduced: bool):
    """Training's attention setup: only `backend` (None: all), math in reduced precision or not."""
    cuda = torch.backends.cuda
    before = cuda.fp16_bf16_reduction_math_sdp_allowed()
    names = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}
    with sdpa_kernel([names[backend]]) if backend else contextlib.nullcontext():
        cuda.allow_fp16_bf16_reduction_math_sdp(reduced)
        try:
            yield
        finally:
            cuda.allow_fp16_bf16_reduction_math_sdp(before)


def record_run(run_dir: str | Path, *, backend: str | None = "math", reduced: bool = True,
               matmul: bool = False, manual: bool = False, steps: int = FAULT_STEP + 1) -> Path:
    """Train `steps` FP16-autocast steps with the Recorder, SDPA switched as given; return run_dir.

    `manual`: also snapshot FAULT_STEP by hand (a step that stays finite is never snapshotted).
    """
    model = build_sdpa(matmul)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with sdpa_switches(backend, reduced), Recorder(
            run_dir, model, factory=f"{REF}:build_sdpa", factory_kwargs={"matmul": matmul},
            loss_fn=f"{REF}:sdpa_mse", amp_dtype=torch.float16) as rec:
        for step in range(steps):
            batch = batch_at(step)
            rec.begin_step(step, batch)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = sdpa_mse(model, batch)
            loss.backward()
            if manual and step == FAULT_STEP:
                rec.snapshot()
            rec.end_step(loss)
            if torch.isfinite(loss):
                opt.step()
            opt.zero_grad(set_to_none=True)
    return Path(run_dir)


if __name__ == "__main__":  # python -m tests.analyzer.replay.sdpa_models RUN_DIR: record, replay, print JSON
    from analyzer.replay import replay_snapshot

    run = record_run(sys.argv[1])
    snap = sorted((run / "snapshots").iterdir())[0]
    result = replay_snapshot(snap, device="cpu")
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), **result.to_dict()}))

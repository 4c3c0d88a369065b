"""Real recorded CPU runs whose failure is born in the optimizer step.

Each ``record_<name>(run_dir, *, check_update=...)`` trains a tiny model with the real
``Recorder`` into `run_dir` and returns an info dict naming what a diagnosis must find (the
step whose update broke or froze the weights, the parameter names, the dtype). Every mechanism
is exact, not rounding luck, so the steps and names are the same on any CPU
(``ATEN_CPU_CAPABILITY=default|avx2|avx512``):

- ``record_fp16_adam_eps``: pure FP16 (``model.half()``, no autocast, no scaler) with
  ``torch.optim.Adam`` at its default ``eps=1e-8``, which is 0 in float16. The embedding is
  frozen for a warm-up (``UNFREEZE`` steps, a common fine-tuning recipe) and then trained: at
  that step every row the batch does not use has gradient 0, ``exp_avg = exp_avg_sq = 0`` and
  the update ``0 / (sqrt(0) + 0)`` is NaN. Rows 8-15 are never used by any batch; rows 0 and 1
  are first used one step later, so the loss is finite at ``UNFREEZE`` and NaN at the next step.
  NB: torch 2.13 runs Adam on CPU tensors with its single-tensor implementation
  (``foreach=None`` resolves to False off CUDA); ``foreach=True`` gives the same NaN.
- ``record_bf16_stall`` / ``record_fp32_stall``: a pure-BF16 MLP whose middle ``Linear`` has
  weights in [1, 1.05). Adam at lr 1e-3 moves a weight by about 1e-3 per step, below half a
  bfloat16 ulp at 1 (2**-8 = 0.0039), so that layer never changes while its gradients are
  normal. The same model in FP32 changes every step.
- ``record_clip_inf``: FP32, no scaler, SGD with momentum. One corrupt input (2e20) at
  ``CLIP_STEP`` makes one weight gradient inf (2e20 * 1e19 overflows float32; the loss, 2.5e37,
  does not); ``clip_grad_norm_`` then scales every gradient by ``1 / (inf + 1e-6) = 0``: the
  inf element becomes ``inf * 0 = NaN`` and the step writes it into the weight.

The factories and the loss are importable references (``tests.update_runs:...``), so
``analyzer replay`` can rebuild the models from the snapshots.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from recorders import Recorder

__all__ = ["UNFREEZE", "CLIP_STEP", "build_embedding_regressor", "build_stall_mlp", "build_linear",
           "regression_loss", "record_fp16_adam_eps", "record_bf16_stall", "record_fp32_stall", "record_clip_inf"]

REF = "tests.update_runs"
UNFREEZE = 3      # record_fp16_adam_eps: the step whose update makes the embedding NaN
CLIP_STEP = 4     # record_clip_inf: the step whose clipped update makes a weight NaN
_TARGET = 10.0    # far from the initial predictions: every used gradient is large (no v flush to 0)


class EmbeddingRegressor(nn.Module):
    """Token -> embedding row -> Linear -> one number per token."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, idx):
        return self.head(self.emb(idx)).squeeze(-1)


def build_embedding_regressor(vocab: int = 16, dim: int = 4, dtype: str = "float16") -> nn.Module:
    """Deterministic weights, all positive: predictions start near 0.2, far from the target 10."""
    model = EmbeddingRegressor(vocab, dim)
    with torch.no_grad():
        model.emb.weight.copy_(0.5 + 0.01 * torch.arange(vocab * dim, dtype=torch.float32).reshape(vocab, dim))
        model.head.weight.fill_(0.1)
        model.head.bias.zero_()
    return model.to(getattr(torch, dtype))


def regression_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """MSE in float32 of the model's (low-precision) output against batch["y"]."""
    return F.mse_loss(model(batch["x"]).float(), batch["y"])


def _token_batch(step: int) -> dict:
    """Step k uses tokens 2k mod 8 and 2k+1 mod 8: rows 8-15 are never used."""
    idx = torch.tensor([(2 * step) % 8, (2 * step + 1) % 8])
    return {"x": idx, "y": torch.full((2,), _TARGET)}


def _train(rec: Recorder, model: nn.Module, opt: torch.optim.Optimizer, batches: list[dict],
           before_step=None) -> list[float]:
    """The README loop: begin_step, forward, backward, end_step, (before_step), step, zero_grad."""
    losses = []
    for step, batch in enumerate(batches):
        rec.begin_step(step, batch)
        loss = regression_loss(model, batch)
        loss.backward()
        rec.end_step(loss)
        if before_step is not None:
            before_step(step, model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def record_fp16_adam_eps(run_dir: str | Path, *, check_update: bool = False, steps: int = 6) -> dict:
    """Pure FP16 + Adam(eps=1e-8): the embedding's update at UNFREEZE is 0/0 = NaN for unused rows."""
    model = build_embedding_regressor()
    model.emb.weight.requires_grad_(False)  # warm-up: the head trains alone
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # eps=1e-8 -> 0 in float16

    def unfreeze(step, model):
        if step + 1 == UNFREEZE:
            model.emb.weight.requires_grad_(True)

    with Recorder(run_dir, model, factory=f"{REF}:build_embedding_regressor", loss_fn=f"{REF}:regression_loss",
                  optimizer=opt, check_update=check_update) as rec:
        losses = _train(rec, model, opt, [_token_batch(s) for s in range(steps)], unfreeze)
    return {"run_dir": Path(run_dir), "nan_step": UNFREEZE, "nan_loss_step": UNFREEZE + 1,
            "params": ["emb.weight"], "dtype": "float16", "eps": 1e-8, "optimizer": "torch.optim.adam.Adam",
            "never_used_rows": list(range(8, 16)), "losses": losses, "snapshots": list(rec.snapshots)}


def build_stall_mlp(dtype: str = "bfloat16") -> nn.Module:
    """Linear(8, 16) -> Tanh -> Linear(16, 16, no bias; weights in [1, 1.05)) -> Tanh -> Linear(16, 1)."""
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16, bias=False), nn.Tanh(), nn.Linear(16, 1))
    with torch.no_grad():
        model[0].weight.copy_(0.05 * torch.randn(16, 8, generator=g))
        model[0].bias.zero_()
        model[2].weight.copy_(1.0 + 0.05 * torch.rand(16, 16, generator=g))
        model[4].weight.copy_(0.05 * torch.randn(1, 16, generator=g))
        model[4].bias.zero_()
    return model.to(getattr(torch, dtype))


def _mlp_batches(n: int, dtype: torch.dtype) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(8, 8, generator=g).to(dtype), "y": torch.randn(8, 1, generator=g)} for _ in range(n)]


def _record_stall(run_dir, dtype: str, check_update: bool, steps: int) -> dict:
    model = build_stall_mlp(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Recorder(run_dir, model, factory=f"{REF}:build_stall_mlp", factory_kwargs={"dtype": dtype},
                  loss_fn=f"{REF}:regression_loss", optimizer=opt, check_update=check_update) as rec:
        losses = _train(rec, model, opt, _mlp_batches(steps, getattr(torch, dtype)))
    return {"run_dir": Path(run_dir), "dtype": dtype, "lr": 1e-3, "stalled": ["2.weight"] if dtype == "bfloat16" else [],
            "changing": ["0.weight", "0.bias", "4.weight", "4.bias"] + ([] if dtype == "bfloat16" else ["2.weight"]),
            "steps": steps, "losses": losses, "snapshots": list(rec.snapshots)}


def record_bf16_stall(run_dir: str | Path, *, check_update: bool = False, steps: int = 40) -> dict:
    """Pure BF16: ``2.weight`` (near 1) never changes; its updates (~1e-3) are below half an ulp (0.0039)."""
    return _record_stall(run_dir, "bfloat16", check_update, steps)


def record_fp32_stall(run_dir: str | Path, *, check_update: bool = False, steps: int = 40) -> dict:
    """The same model and data in FP32: every layer changes, ``2.weight`` included."""
    return _record_stall(run_dir, "float32", check_update, steps)


def build_linear(dtype: str = "float32") -> nn.Module:
    """Linear(4, 1) with every weight 0.05: a spike of 2e20 in input 0 predicts 1e19."""
    model = nn.Sequential(nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(0.05)
        model[0].bias.zero_()
    return model.to(getattr(torch, dtype))


def _spike_batches(n: int) -> list[dict]:
    """y = x . 0.05 (the model's own weights): small gradients, until CLIP_STEP's corrupt x[0, 0] = 2e20."""
    g = torch.Generator().manual_seed(2)
    out = []
    for step in range(n):
        x = torch.randn(4, 4, generator=g)
        y = x.sum(dim=1, keepdim=True) * 0.05 + 0.01 * torch.randn(4, 1, generator=g)
        if step == CLIP_STEP:
            x[0, 0] = 2e20  # corrupt record; y stays normal: loss 2.5e37 (finite), dL/dw00 = 1e39 (inf)
        out.append({"x": x, "y": y})
    return out


def record_clip_inf(run_dir: str | Path, *, check_update: bool = False, steps: int = 7) -> dict:
    """FP32, no scaler: clip_grad_norm_ over an inf gradient at CLIP_STEP makes ``0.weight`` NaN."""
    model = build_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def clip(step, model):
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)

    with Recorder(run_dir, model, factory=f"{REF}:build_linear", loss_fn=f"{REF}:regression_loss",
                  optimizer=opt, check_update=check_update) as rec:
        losses = _train(rec, model, opt, _spike_batches(steps), clip)
    return {"run_dir": Path(run_dir), "nan_step": CLIP_STEP, "nan_loss_step": CLIP_STEP + 1, "params": ["0.weight"],
            "dtype": "float32", "max_norm": 1.0, "optimizer": "torch.optim.sgd.SGD", "losses": losses,
            "snapshots": list(rec.snapshots)}

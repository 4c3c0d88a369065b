"""A tiny transformer whose SwiGLU w1/w3 rows align on one rare token (Fishman et al. 2024's mechanism).

Channel ``OUTLIER`` of ``w1`` and ``w3`` points along the one embedding direction only token ``RARE``
has, with norm ``GAIN``: on that token ``silu(w1 x) * (w3 x)`` is about ``(GAIN * sqrt(DIM))**2`` = 2e4,
while the other channels and tokens stay near 0.01 (weights of std 0.03). One tensorwise e4m3 scale set
by 2e4 flushes every value below about 0.04 to zero: most of w2's input. Rowwise scales isolate the rows
of the rare token, which are 2 of 64 here. Everything else in the model is ordinary.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REF = "tests.analyzer.replay.fp8.swiglu_models"
VOCAB, DIM, HIDDEN, RARE, OUTLIER, GAIN = 64, 32, 64, 0, 5, 25.0


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, gate: float = 1.0):
        return self.w2(F.silu(self.w1(x)) * self.w3(x) * gate)  # gate 0: w2's input is all zeros


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, heads: int = 2):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim, elementwise_affine=False), nn.RMSNorm(dim)
        self.mlp = SwiGLU(dim, hidden)
        self.qkv, self.proj, self.heads = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False), heads

    def forward(self, x, gate: float = 1.0):
        x = x + self.mlp(self.norm1(x), gate)  # the MLP first: its input is the token's own embedding
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm2(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(a.transpose(1, 2).reshape(b, t, d))


class TinyLM(nn.Module):
    def __init__(self, aligned: bool = True):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.block = Block(DIM, HIDDEN)
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():
            for lin in (self.block.mlp.w1, self.block.mlp.w3, self.block.mlp.w2):
                lin.weight.normal_(0, 0.03)
            self.emb.weight[:, DIM - 1] = 0.0  # the last direction is the rare token's alone
            self.emb.weight[RARE] = 0.0
            self.emb.weight[RARE, DIM - 1] = 1.0
            if aligned:
                for lin in (self.block.mlp.w1, self.block.mlp.w3):
                    lin.weight[OUTLIER] = 0.0
                    lin.weight[OUTLIER, DIM - 1] = GAIN

    def forward(self, idx, gate: float = 1.0):
        return self.head(self.norm(self.block(self.emb(idx), gate)))


def build(aligned: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return TinyLM(aligned)


def lm_loss(model, batch):
    """Mean cross-entropy; with a ``w`` entry, the per-token losses weighted by it (a weighted mean)."""
    logits = model(batch["idx"], float(batch["gate"]) if "gate" in batch else 1.0)
    if "w" not in batch:
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), batch["y"].flatten(), reduction="none")
    w = batch["w"].flatten().to(per_token.dtype)
    return (per_token * w).sum() / w.sum()


def weighted_batch(seed: int = 0, heavy: float = 1e6) -> dict:
    """``batch(seed)`` whose two rare-token positions weigh `heavy` times the other 62 in the loss."""
    b = batch(seed)
    b["w"] = torch.where(b["idx"] == RARE, heavy, 1.0)
    return b


def batch(seed: int = 0) -> dict:
    """64 tokens (4 x 16) of which exactly 2 are the rare token."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(1, VOCAB, (4, 16), generator=g)
    idx[0, 3] = idx[2, 9] = RARE
    return {"idx": idx, "y": torch.randint(0, VOCAB, (4, 16), generator=g)}


def build_fp8(aligned: bool = True, recipe: str = "tensorwise") -> nn.Module:
    """A factory that returns the model already converted (torchao): replay reads the recipe from the model."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return convert_to_float8_training(build(aligned), config=Float8LinearConfig.from_recipe_name(recipe))


def train_fp8(run_dir, *, aligned: bool = True, recipe: str = "tensorwise", steps: int = 2, gate_at: int | None = None,
              factory: str = "build", write_recipe: bool = True, amp: bool = True, micro: int = 1,
              heavy: float | None = None) -> Path:
    """Train with torchao FP8 (BF16 autocast) under the real Recorder and snapshot the last step by hand (reason ``fp8``).

    `gate_at`: the step whose batch gates the SwiGLU branch by 0 (an all-zero w2 input). `write_recipe`
    adds ``describe_fp8(model)`` to the snapshot as its ``fp8_recipe`` entry where the recorder wrote none.
    `amp=False`: FP8 with FP32 master weights and no autocast; `micro`: micro-batches accumulated per step;
    `heavy`: the rare tokens weigh this many times the others in the loss (``weighted_batch``).
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from recorders import Recorder
    from recorders.fp8_recipe import describe_fp8

    model = build(aligned)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    kwargs = {"aligned": aligned} if factory == "build" else {"aligned": aligned, "recipe": recipe}
    with Recorder(run_dir, model, factory=f"{REF}:{factory}", factory_kwargs=kwargs, loss_fn=f"{REF}:lm_loss",
                  amp_dtype=torch.bfloat16 if amp else None, optimizer=opt) as rec:
        for step in range(steps):
            parts = [batch(step * micro + i) if heavy is None else weighted_batch(step * micro + i, heavy)
                     for i in range(micro)]
            for b in parts if step == gate_at else ():
                b["gate"] = torch.tensor(0.0)
            rec.begin_step(step, parts[0] if micro == 1 else parts)
            for b in parts:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    loss = lm_loss(model, b) / micro
                loss.backward()
            snap = rec.snapshot("fp8") if step == steps - 1 else None  # the reason the recorder's fp8 trigger writes
            rec.end_step(loss)
            opt.step()
            opt.zero_grad()
    assert snap is not None, "the recorder wrote no snapshot"
    data = torch.load(snap, weights_only=True)
    if write_recipe and "fp8_recipe" not in data:
        data["fp8_recipe"] = describe_fp8(model)
        torch.save(data, snap)
    return Path(snap)

"""A NaN only FP8 makes: a quiet token's whole row flushed to zero by a tensorwise scale that a loud token set.

Token ``LOUD``'s embedding holds one value of ``LOUD_VALUE`` (1e4); token ``QUIET``'s whole embedding is
``QUIET_VALUE`` (1e-3). torchao's tensorwise e4m3 cast of ``proj``'s input takes its scale from 1e4: every value
below about 1e4 / (448 * 2**10) = 0.02 becomes 0, so the quiet token's row is all zeros, ``proj``'s output row
for it is 0 (no bias), and ``Normalize`` (``x / x.norm(dim=-1, keepdim=True)``, no epsilon) makes 0 / 0 = NaN.
In FP32 and BF16 the row is 1e-3-small and the division is finite.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

REF = "tests.analyzer.replay.fp8.nan_models"
VOCAB, DIM, LOUD, QUIET, LOUD_VALUE, QUIET_VALUE = 32, 32, 1, 2, 1e4, 1e-3


class Normalize(nn.Module):
    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)  # no epsilon: a zero row is 0 / 0


class NormLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.normalize = Normalize()
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():
            self.emb.weight[LOUD] = 0.0
            self.emb.weight[LOUD, 0] = LOUD_VALUE
            self.emb.weight[QUIET] = QUIET_VALUE

    def forward(self, idx):
        return self.head(self.normalize(self.proj(self.emb(idx))))


def build() -> nn.Module:
    torch.manual_seed(0)
    return NormLM()


def lm_loss(model, batch):
    return F.cross_entropy(model(batch["idx"]).flatten(0, 1), batch["y"].flatten())


def batch(seed: int = 0) -> dict:
    """2 x 16 tokens; one loud and one quiet token in the first row."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(3, VOCAB, (2, 16), generator=g)
    idx[0, 2], idx[0, 7] = LOUD, QUIET
    return {"idx": idx, "y": torch.randint(0, VOCAB, (2, 16), generator=g)}


def train(run_dir, steps: int = 1):
    """Tensorwise FP8 under BF16 autocast, as a user writes it, with the Recorder: the NaN loss snapshots itself."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from recorders import Recorder

    model = convert_to_float8_training(build(), config=Float8LinearConfig.from_recipe_name("tensorwise"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with Recorder(run_dir, model, factory=f"{REF}:build", loss_fn=f"{REF}:lm_loss", amp_dtype=torch.bfloat16,
                  optimizer=opt) as rec:
        for step in range(steps):
            b = batch(step)
            rec.begin_step(step, b)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = lm_loss(model, b)
            loss.backward()
            rec.end_step(loss)
            opt.step()
            opt.zero_grad()
    return list(rec.snapshots)

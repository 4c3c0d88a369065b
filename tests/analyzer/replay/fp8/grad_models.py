"""FP8 gradients whose range passes e4m3's: a loss that weighs some tokens ``HEAVY`` times the others.

The tiny transformer of ``swiglu_models`` (no aligned rows), with ``w3``'s column for the rare token's own
embedding direction zeroed: the SwiGLU's output, ``w2``'s input, is exactly 0 on the rare token. The rare token
sits at position 0 of each row (causal attention: its gradient reaches no other position) and weighs ``HEAVY``
(1e6) times the others in the loss. So the gradient of ``w2``'s output is 1e6 times larger on the rare tokens
than on the others, while ``w2``'s weight gradient comes from the others alone (the rare token's input is 0).

Under torchao's rowwise recipe the weight-gradient GEMM's grad_output is e4m3 with a scale per output feature
over the tokens: the rare tokens set each scale, and the other tokens' gradients, 1e6 times smaller (beyond
e4m3's range of about 2.3e5), flush to zero: ``w2``'s weight gradient is lost. e5m2 (range about 3.8e9) keeps it.
"""
from __future__ import annotations

import torch

from . import swiglu_models as sm

REF = "tests.analyzer.replay.fp8.grad_models"
HEAVY = 1e6


def build() -> torch.nn.Module:
    model = sm.build(aligned=False)
    with torch.no_grad():
        model.block.mlp.w3.weight[:, sm.DIM - 1] = 0.0  # the rare token's direction: its SwiGLU output is 0
    return model


def batch(seed: int = 0) -> dict:
    """4 x 16 tokens, the rare token first in every row, weighing HEAVY times the other 60 in the loss."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(1, sm.VOCAB, (4, 16), generator=g)
    idx[:, 0] = sm.RARE
    w = torch.ones(4, 16)
    w[:, 0] = HEAVY
    return {"idx": idx, "y": torch.randint(0, sm.VOCAB, (4, 16), generator=g), "w": w}


def train(run_dir, recipe: str = "rowwise") -> list:
    """One step of torchao FP8 (BF16 autocast) under the Recorder (``fp8_every=1``); returns its snapshots."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from recorders import Recorder

    model = convert_to_float8_training(build(), config=Float8LinearConfig.from_recipe_name(recipe))
    with Recorder(run_dir, model, factory=f"{REF}:build", loss_fn=f"{sm.REF}:lm_loss",
                  amp_dtype=torch.bfloat16, fp8_every=1) as rec:
        b = batch(0)
        rec.begin_step(0, b)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = sm.lm_loss(model, b)
        loss.backward()
        rec.end_step(loss)  # the recorder's own trigger snapshots it: the weight gradient's grad_output cast flushes
    return list(rec.snapshots)

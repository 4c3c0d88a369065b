"""Loss outside autocast: the model runs under FP16 autocast, but the loss is computed after the block.

What is wrong:
    the loop does ``with torch.autocast(...): logits = model(idx)`` and then calls
    ``F.cross_entropy(logits, targets)`` *outside* the block. Inside autocast, cross_entropy
    runs in FP32; outside, it receives FP16 logits and returns an FP16 loss, so the loss (and
    the softmax under it) is computed with an 11-bit mantissa: a loss near 3.0 moves in steps
    of about 0.002, and small improvements round away.

What the analyzer should conclude, and why that is right:
    - ``analyzer report``: ``low_precision_loss``. The recorder stores each step's loss dtype
      and it is ``float16`` on every step; an FP16 loss can only come from a loss computed
      outside autocast (inside it, cross_entropy always returns FP32).
    - Nothing else is wrong with this run, so it writes no snapshot: there is no failing step
      to replay. The fix is to move the loss into the autocast block.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from . import models
from ._common import Progress, gpt_batches, main, train

__all__ = ["run", "STEPS", "GPT_KWARGS"]

STEPS = 30
GPT_KWARGS = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, scale_attn_logits=True)


def forward_then_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The bug: only the forward is under autocast; cross_entropy gets FP16 logits."""
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(batch["idx"])
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())


def run(out_dir: str | Path, steps: int | None = None, progress: Progress | None = None, *, seed: int = 0) -> Path:
    """Train the healthy GPT with its loss outside autocast; return the run dir."""
    torch.manual_seed(seed)
    model = models.build_gpt(**GPT_KWARGS)
    return train(
        out_dir, name="loss_outside_autocast", model=model, factory=f"{models.__name__}:build_gpt",
        factory_kwargs=GPT_KWARGS, loss_fn=models.gpt_loss,
        batches=gpt_batches(vocab_size=32, block_size=16, batch_size=16, seed=seed),
        steps=steps or STEPS, amp_dtype=torch.float16,
        optimizer=torch.optim.Adam(model.parameters(), lr=3e-3),
        use_scaler=True, progress=progress, forward=forward_then_loss,
    )


if __name__ == "__main__":
    main(run, __doc__, default_steps=STEPS)

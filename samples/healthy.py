"""Healthy: the same tiny GPT as fp16_attention_overflow, trained correctly with FP16 and GradScaler.

What is different from fp16_attention_overflow:
    the attention logits are divided by sqrt(head_dim) (``scale_attn_logits=True``) and Adam
    runs at ``lr=3e-3``, a normal learning rate for a model this size. Everything else (data,
    sizes, FP16 autocast, GradScaler with its default settings) is the same.

What the analyzer should conclude, and why that is right:
    - ``analyzer report``: no ``error`` and no ``warning`` findings. The loss falls, every loss
      is finite, and the scale stays at GradScaler's initial 65536 or backs off a step or two
      at the start, which is GradScaler calibrating itself, not a problem.
    - The run forces one snapshot of its last step (``reason="manual"``), and
      ``analyzer replay`` of it says ``healthy``: the step is finite in every precision.
    This is the baseline that keeps the checks honest: a detector that fires here is wrong.
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import models
from ._common import Progress, gpt_batches, main, train

__all__ = ["run", "STEPS", "GPT_KWARGS"]

STEPS = 60
GPT_KWARGS = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, scale_attn_logits=True)


def run(out_dir: str | Path, steps: int | None = None, progress: Progress | None = None, *, seed: int = 0) -> Path:
    """Train the correctly scaled GPT with FP16 autocast and GradScaler; return the run dir."""
    torch.manual_seed(seed)
    model = models.build_gpt(**GPT_KWARGS)
    return train(
        out_dir, name="healthy", model=model, factory=f"{models.__name__}:build_gpt", factory_kwargs=GPT_KWARGS,
        loss_fn=models.gpt_loss, batches=gpt_batches(vocab_size=32, block_size=16, batch_size=16, seed=seed),
        steps=steps or STEPS, amp_dtype=torch.float16,
        optimizer=torch.optim.Adam(model.parameters(), lr=3e-3),
        use_scaler=True, progress=progress, snapshot_last=True,
    )


if __name__ == "__main__":
    main(run, __doc__, default_steps=STEPS)

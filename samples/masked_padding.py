"""Masked padding: ``masked_fill(-inf)`` on padded keys, and a batch that holds a fully padded sequence.

What is wrong:
    the GPT masks padded keys with ``-inf`` (``pad_mask=True``) before the softmax, and the
    loss averages over real tokens by multiplying per-token losses by a keep mask. At step 15
    one sequence in the batch is empty: every one of its keys is padding, so every attention
    row of it is all ``-inf``, and softmax of an all ``-inf`` row is ``0/0 = NaN``. The NaN
    flows down the residual stream of that sequence and ``NaN * 0`` keeps it in the loss.

What the analyzer should conclude, and why that is right:
    - ``analyzer report``: ``nonfinite_loss`` at step 15, with a stable scale before it (this
      is not an overflow).
    - ``analyzer replay``: verdict ``numerical_bug`` in forward, in ``blocks.0.attn`` (the
      first attention that sees the empty row). FP32 gives the same NaN, because a softmax
      over nothing but ``-inf`` is undefined in any precision. The fix is a finite mask value
      (``torch.finfo(dtype).min``), or dropping empty sequences from the batch.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from . import models
from ._common import Progress, gpt_batches, main, train

__all__ = ["run", "STEPS", "BAD_STEP", "GPT_KWARGS"]

STEPS = 25
BAD_STEP = 15
GPT_KWARGS = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, pad_mask=True)


def _batches(seed: int) -> Iterator[dict]:
    """Right-padded sequences of 4..16 real tokens; at BAD_STEP, sequence 0 has none."""
    g = torch.Generator().manual_seed(seed + 1)
    for step, batch in enumerate(gpt_batches(vocab_size=32, block_size=16, batch_size=16, seed=seed)):
        lengths = torch.randint(4, 17, (16,), generator=g)
        if step == BAD_STEP:
            lengths[0] = 0
        pad = torch.arange(16) >= lengths[:, None]
        batch["idx"] = batch["idx"].masked_fill(pad, 0)
        batch["pad"] = pad
        yield batch


def run(out_dir: str | Path, steps: int | None = None, progress: Progress | None = None, *, seed: int = 0) -> Path:
    """Train the padded-attention GPT with FP16 autocast and GradScaler; return the run dir."""
    torch.manual_seed(seed)
    model = models.build_gpt(**GPT_KWARGS)
    return train(
        out_dir, name="masked_padding", model=model, factory=f"{models.__name__}:build_gpt", factory_kwargs=GPT_KWARGS,
        loss_fn=models.gpt_masked_loss, batches=_batches(seed), steps=steps or STEPS,
        amp_dtype=torch.float16, optimizer=torch.optim.Adam(model.parameters(), lr=3e-3),
        use_scaler=True, progress=progress,
    )


if __name__ == "__main__":
    main(run, __doc__, default_steps=STEPS)

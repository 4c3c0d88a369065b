"""FP16 attention overflow: attention logits not divided by sqrt(d), and a learning rate that grows them.

What is wrong:
    ``CausalSelfAttention`` is built with ``scale_attn_logits=False``, so ``q @ k^T`` is not
    multiplied by ``1/sqrt(head_dim)``. Adam at ``lr=0.3`` makes the q/k projections grow step
    after step, and with them the logits, which are sums over ``head_dim`` products. Under FP16
    autocast the matmul accumulates in FP32 but casts its result to FP16: once a logit passes
    65504 it becomes ``inf``, softmax turns ``inf - inf`` into NaN and the loss is NaN.
    GradScaler reads every NaN step as a gradient overflow, skips it and halves the scale;
    skipped steps leave the weights as they were, so later steps keep overflowing and the scale
    collapses.

What the analyzer should conclude, and why that is right:
    - ``analyzer report``: ``nonfinite_loss`` at the first NaN (step 24 with seed 0) and
      ``scale_collapse`` (the scale halves on almost every step after it, with no recovery,
      down to far below 1). Both are plain facts of the trace.
    - ``analyzer replay`` of the first snapshot: verdict ``overflow``, culprit a matmul in
      forward inside ``blocks.N.attn``. The same weights and batch give a finite loss in FP32
      and in BF16 (whose range is FP32's), so precision range is the cause, not the maths;
      the first op that turns finite inputs into ``inf`` is the ``q @ k^T`` matmul.
    - The fix: divide the logits by sqrt(d) (``scale_attn_logits=True``), lower the learning
      rate, or train in BF16 (``--amp bf16`` runs this script in BF16 and stays finite).
"""
from __future__ import annotations

from pathlib import Path

import torch

from samples import models
from samples._common import Progress, gpt_batches, main, train

__all__ = ["run", "STEPS", "GPT_KWARGS"]

STEPS = 60  # with seed 0 the first NaN is at step 24 and the scale is below 1 from step 41 on
GPT_KWARGS = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, scale_attn_logits=False)


def run(out_dir: str | Path, steps: int | None = None, progress: Progress | None = None, *,
        amp: str = "fp16", seed: int = 0) -> Path:
    """Train the unscaled-attention GPT with FP16 (or ``amp="bf16"``) autocast; return the run dir."""
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[amp]
    torch.manual_seed(seed)
    model = models.build_gpt(**GPT_KWARGS)
    return train(
        out_dir, name="fp16_attention_overflow" if amp == "fp16" else "fp16_attention_overflow (bf16)",
        model=model, factory="samples.models:build_gpt", factory_kwargs=GPT_KWARGS,
        loss_fn=models.gpt_loss,
        batches=gpt_batches(vocab_size=32, block_size=16, batch_size=16, seed=seed),
        steps=steps or STEPS, amp_dtype=amp_dtype,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.3),
        use_scaler=amp == "fp16", progress=progress,
    )


if __name__ == "__main__":
    main(run, __doc__, default_steps=STEPS, extra={"--amp": dict(choices=["fp16", "bf16"], default="fp16",
                                                             help="autocast dtype (default fp16)")})

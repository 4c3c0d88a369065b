"""FP16 attention overflow: attention logits not divided by sqrt(d), then sharpened 100,000 times by a temperature.

What is wrong:
    ``CausalSelfAttention`` is built with ``scale_attn_logits=False``, so ``q @ k^T`` is not
    multiplied by ``1/sqrt(head_dim)``, and with ``attn_temperature=True``: the logits are
    divided by a temperature ``tau`` that the training loop sets. The loop's schedule keeps
    ``tau = 1`` for 24 steps of warm-up, then sharpens attention to ``tau = 1e-5`` (meant as
    a gentle 0.5; the exponent is a typo). From step 24 on the logits are 100,000 times larger:
    a few units become a few 100,000s. FP32 and BF16 hold them (softmax of such logits is just
    very sharp), but under FP16 autocast the matmul casts its FP32 result to FP16, a logit past
    65504 becomes ``inf``, softmax turns ``inf - inf`` into NaN and the loss is NaN.
    GradScaler reads every NaN step as a gradient overflow, skips it and halves the scale;
    skipped steps leave the weights as they were, so every later step overflows too and the
    scale collapses.

    NB: the failure is built so that it happens at the same step on every CPU. The jump is
    100,000x while the largest logit of a batch before it is a few units, so FP16 rounding,
    which differs with the CPU's SIMD width, cannot move it by a step. The GradScaler starts
    at 4096 instead of 65536: on this model the default puts the largest FP16 gradient within
    a few percent of 65504 on some warm-up steps, where whether a step is skipped would depend
    on rounding.

What the analyzer should conclude, and why that is right:
    - ``analyzer report``: ``nonfinite_loss`` at step 24 with a stable scale before it, and
      ``scale_collapse`` (the scale halves on every step after it, with no recovery, down to
      far below 1). Both are plain facts of the trace.
    - ``analyzer replay`` of the first snapshot: verdict ``overflow``, culprit the ``q @ k^T``
      matmul (``aten.bmm``) in forward inside ``blocks.0.attn``. The same weights and batch
      give a finite loss in FP32 and in BF16 (whose range is FP32's), so precision range is the
      cause, not the maths; the first op that turns finite inputs into ``inf`` is that matmul.
      The answer says why the logits are that large: ``q`` and ``k`` were multiplied by 316, the
      ``rsqrt`` of the ``temperature`` buffer (1e-5), the largest jump in magnitude before the matmul.
    - The fix: keep the temperature sane, or train in BF16 (``--amp bf16`` runs this script in
      BF16 and stays finite; its report warns ``exploding_gradients`` from step 24, rightly: the
      1/tau multiplies the gradients of q and k as well). Dividing the logits by sqrt(d)
      (``scale_attn_logits=True``) alone is not enough: with head_dim 16 the largest logit (about
      340,000 in FP32) would still be about 85,000, past 65504, and the replay says so.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from . import models
from ._common import Progress, gpt_batches, main, train

__all__ = ["run", "temperature", "STEPS", "BAD_STEP", "TAU_FINAL", "INIT_SCALE", "GPT_KWARGS"]

STEPS = 60
BAD_STEP = 24    # the first step at tau = TAU_FINAL, hence the first NaN
TAU_FINAL = 1e-5
INIT_SCALE = 2.0**12
GPT_KWARGS = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, scale_attn_logits=False,
                  attn_temperature=True)


def temperature(step: int) -> float:
    """The loop's schedule: ``tau = 1`` while warming up, then ``TAU_FINAL`` from ``BAD_STEP`` on."""
    return 1.0 if step < BAD_STEP else TAU_FINAL


def _set_temperature(model: nn.Module, step: int) -> None:
    models.set_attn_temperature(model, temperature(step))


def run(out_dir: str | Path, steps: int | None = None, progress: Progress | None = None, *,
        amp: str = "fp16", seed: int = 0) -> Path:
    """Train the unscaled-attention GPT with FP16 (or ``amp="bf16"``) autocast; return the run dir."""
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[amp]
    torch.manual_seed(seed)
    model = models.build_gpt(**GPT_KWARGS)
    return train(
        out_dir, name="fp16_attention_overflow" if amp == "fp16" else "fp16_attention_overflow (bf16)",
        model=model, factory=f"{models.__name__}:build_gpt", factory_kwargs=GPT_KWARGS,
        loss_fn=models.gpt_loss,
        batches=gpt_batches(vocab_size=32, block_size=16, batch_size=16, seed=seed),
        steps=steps or STEPS, amp_dtype=amp_dtype,
        optimizer=torch.optim.Adam(model.parameters(), lr=3e-3),
        use_scaler=amp == "fp16", init_scale=INIT_SCALE, progress=progress, before_step=_set_temperature,
    )


if __name__ == "__main__":
    main(run, __doc__, default_steps=STEPS, extra={"--amp": dict(choices=["fp16", "bf16"], default="fp16",
                                                             help="autocast dtype (default fp16)")})

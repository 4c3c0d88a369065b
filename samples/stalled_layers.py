"""Stalled layers: a deep sigmoid MLP without residuals, with a small init, whose early layers get no gradient.

What is wrong:
    twelve ``Linear -> Sigmoid`` layers, no residual connections, weights drawn with std 0.05.
    Backward multiplies the gradient by ``sigmoid' <= 0.25`` times a small weight matrix at
    every layer, so it shrinks by roughly ten times per layer: the last layers learn, the first
    ones receive gradients ten orders of magnitude smaller, which in FP16 round to exactly
    zero. The loss stays finite; the network just trains as if it were a few layers deep.

What the analyzer should conclude, and why that is right:
    - ``analyzer report``: ``stalled_layers`` and/or ``vanishing_gradients``, naming the
      *early* layers (``layers.0.weight`` ...). The per-layer gradient norms in the trace fall
      steadily with depth from the head back to the input, so the stalled layers are the early
      ones and the cause is vanishing through depth, not a layer sitting on a dead residual.
    - No loss is non-finite, so there is no snapshot to replay. The fix is residual
      connections or normalisation, a ReLU-family activation, or a standard init.
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import models
from ._common import Progress, main, teacher_batches, train

__all__ = ["run", "STEPS", "MLP_KWARGS"]

STEPS = 40
MLP_KWARGS = dict(in_features=16, width=32, depth=12, n_classes=4, activation="sigmoid", init_std=0.05)


def run(out_dir: str | Path, steps: int | None = None, progress: Progress | None = None, *, seed: int = 0) -> Path:
    """Train the deep sigmoid MLP with FP16 autocast and GradScaler; return the run dir."""
    torch.manual_seed(seed)
    model = models.build_mlp(**MLP_KWARGS)
    return train(
        out_dir, name="stalled_layers", model=model, factory=f"{models.__name__}:build_mlp",
        factory_kwargs=MLP_KWARGS, loss_fn=models.mlp_loss,
        batches=teacher_batches(in_features=16, n_classes=4, batch_size=64, seed=seed),
        steps=steps or STEPS, amp_dtype=torch.float16,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), use_scaler=True, progress=progress,
    )


if __name__ == "__main__":
    main(run, __doc__, default_steps=STEPS)

"""BF16 NaN: a normalisation without eps divides 0 by 0 when a feature is constant across the batch.

What is wrong:
    the MLP standardises its inputs per batch, ``(x - mean) / std``, with no eps
    (``standardize=True``). Feature 3 is an on/off flag. At step 12 every record in the batch
    has it on (one site's data arrived as a single batch), so its mean is exactly 1, its std
    exactly 0, and ``0 / 0`` is NaN. The run is BF16 without a scaler, as BF16 runs are.

What the analyzer should conclude, and why that is right:
    - ``analyzer report``: ``nonfinite_loss`` at step 12, noting the run is BF16: BF16 has
      FP32's exponent range, so a NaN in BF16 is a numerical problem, not an overflow.
    - ``analyzer replay``: verdict ``numerical_bug``, culprit the division (``aten.div``) in
      forward in module ``norm``. The FP32 replay gives the same NaN because the input
      standardisation runs in FP32 anyway (autocast does not touch mean, std or div), and the
      first op with finite inputs and a non-finite output is the ``0 / 0``. The fix is an eps:
      ``(x - mean) / (std + eps)``.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from . import models
from ._common import Progress, main, teacher_batches, train

__all__ = ["run", "STEPS", "BAD_STEP", "MLP_KWARGS"]

STEPS = 20
BAD_STEP = 12
FLAG = 3  # the on/off feature
MLP_KWARGS = dict(in_features=16, width=64, depth=3, n_classes=4, standardize=True)


def _batches(seed: int) -> Iterator[dict]:
    g = torch.Generator().manual_seed(seed + 1)
    sizes = dict(in_features=MLP_KWARGS["in_features"], n_classes=MLP_KWARGS["n_classes"])
    for step, batch in enumerate(teacher_batches(batch_size=64, seed=seed, **sizes)):
        on = torch.rand(64, generator=g) < 0.5
        batch["x"][:, FLAG] = 1.0 if step == BAD_STEP else on.float()
        yield batch


def run(out_dir: str | Path, steps: int | None = None, progress: Progress | None = None, *, seed: int = 0) -> Path:
    """Train the standardising MLP in BF16 (no scaler); return the run dir."""
    torch.manual_seed(seed)
    model = models.build_mlp(**MLP_KWARGS)
    return train(
        out_dir, name="bf16_nan", model=model, factory=f"{models.__name__}:build_mlp", factory_kwargs=MLP_KWARGS,
        loss_fn=models.mlp_loss, batches=_batches(seed), steps=steps or STEPS,
        amp_dtype=torch.bfloat16, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
        use_scaler=False, progress=progress,
    )


if __name__ == "__main__":
    main(run, __doc__, default_steps=STEPS)

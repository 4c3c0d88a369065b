"""Custom op outside autocast: a ``torch.library`` op with no autocast registration gets FP16 inputs and overflows.

What is wrong:
    the CNN's activation is ``samples::softplus``, a hand-fused ``log(1 + exp(x))`` made with
    ``torch.library.custom_op`` but never registered with autocast. Autocast only casts the ops
    it knows, so the op receives the FP16 output of the conv before it and computes in FP16,
    where ``exp(x)`` is ``inf`` as soon as ``x`` passes log(65504) ~= 11.09. As the CNN learns,
    its conv outputs grow; at step 28 (seed 0) one passes 11.09, the op returns ``inf`` and
    the loss is NaN. (The largest input of ``features.4`` is 10.33 at step 27 and 11.20 at
    step 28, the same with avx512, avx2 and default ATen kernels, and with oneDNN held to AVX2
    or SSE4.1: Adam at ``lr=1e-2`` trains this CNN smoothly, so FP16 rounding moves these
    values in the 4th digit, not across 11.09.) In FP32 the same formula is finite up to x ~= 88, and its output (~x)
    fits FP16 easily: only the op's internal ``exp`` needs FP32.

What the analyzer should conclude, and why that is right:
    - ``analyzer report``: ``nonfinite_loss`` at the first NaN, with a stable scale before it.
    - ``analyzer replay``: verdict ``unregistered_op``, culprit ``samples.softplus`` in
      forward, in one of the two activation modules (``features.4`` with seed 0). In FP32 the
      step is finite, and the first op turning finite inputs into ``inf`` in FP16 is the
      custom op, which got FP16 inputs because autocast has no rule for it.
    - The fix is ``torch.library.register_autocast("samples::softplus", "cpu", torch.float32)``.
      ``--register-autocast`` runs this script with exactly that line added, and the run
      stays finite.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from . import models
from ._common import Progress, main, train

__all__ = ["run", "STEPS", "FIRST_NAN_STEP", "CNN_KWARGS"]

STEPS = 40
FIRST_NAN_STEP = 28  # with seed 0
CNN_KWARGS = dict(in_channels=1, image_size=12, channels=8, n_classes=4)


def _batches(seed: int, batch_size: int = 32) -> Iterator[dict]:
    """12x12 noisy images with a 3x3 bright blob, standardised; the class is the blob's quadrant."""
    g = torch.Generator().manual_seed(seed)
    size, half = CNN_KWARGS["image_size"], CNN_KWARGS["image_size"] // 2
    while True:
        y = torch.randint(0, 4, (batch_size,), generator=g)
        x = torch.rand(batch_size, 1, size, size, generator=g) * 0.5
        rows = (y // 2) * half + torch.randint(0, half - 2, (batch_size,), generator=g)
        cols = (y % 2) * half + torch.randint(0, half - 2, (batch_size,), generator=g)
        for i in range(batch_size):
            x[i, 0, rows[i]:rows[i] + 3, cols[i]:cols[i] + 3] += 0.5
        yield {"x": (x - 0.3) / 0.25, "y": y}  # mean 0.3, std 0.25, as torchvision's Normalize would


def run(out_dir: str | Path, steps: int | None = None, progress: Progress | None = None, *,
        register_autocast: bool = False, seed: int = 0) -> Path:
    """Train the custom-softplus CNN with FP16 autocast and GradScaler; return the run dir.

    ``register_autocast=True`` applies the fix first. NB: the registration is global to the
    process and cannot be undone, so it is meant for a fresh process (the command line).
    """
    if register_autocast:
        torch.library.register_autocast("samples::softplus", "cpu", torch.float32)
    torch.manual_seed(seed)
    model = models.build_cnn(**CNN_KWARGS)
    return train(
        out_dir, name="custom_op_outside_autocast", model=model, factory=f"{models.__name__}:build_cnn",
        factory_kwargs=CNN_KWARGS, loss_fn=models.cnn_loss, batches=_batches(seed), steps=steps or STEPS,
        amp_dtype=torch.float16, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
        use_scaler=True, progress=progress,
    )


if __name__ == "__main__":
    main(run, __doc__, default_steps=STEPS, extra={"--register-autocast": dict(
        action="store_true", help="register samples::softplus with autocast (FP32) first: the fix")})

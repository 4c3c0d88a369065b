"""Log of zero: a hand-written NLL, ``-log(softmax(logits))``, meets a probability that is exactly 0.

What is wrong:
    the loss is ``mlp_nll_loss``: softmax (in FP32, the usual precaution), then log, then pick
    the target. At step 20 the batch holds one corrupted record: its features are in the wrong
    unit (x100) and its label is the class the features argue *against*. Its logits are 100
    times larger than usual, the target's logit sits hundreds below the top one, and
    ``exp(-300)`` is 0 in FP16, BF16 and FP32 alike. ``log(0) = -inf``, so the loss is
    ``inf``. ``F.cross_entropy`` computes log-softmax directly and would have returned a
    large but finite loss.

What the analyzer should conclude, and why that is right:
    - ``analyzer report``: ``nonfinite_loss`` at step 20, with the scale stable before it, so
      the message says this is not a loss-scale overflow and points at the snapshot.
    - ``analyzer replay``: verdict ``numerical_bug``, culprit ``aten.log`` in forward, in
      ``<loss_fn>`` (the replay's name for ops outside the model's modules). The FP32 replay
      of the same weights and batch is non-finite too, so no precision setting can fix it;
      the first op that turns finite inputs (probabilities in [0, 1]) into a non-finite
      output is the log. The fix is ``log_softmax`` / ``cross_entropy``, or a clamp before
      the log.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from . import models
from ._common import Progress, main, teacher_batches, teacher_weights, train

__all__ = ["run", "STEPS", "BAD_STEP", "MLP_KWARGS"]

STEPS = 30
BAD_STEP = 20
MLP_KWARGS = dict(in_features=16, width=64, depth=2, n_classes=4)


def _batches(seed: int) -> Iterator[dict]:
    sizes = dict(in_features=MLP_KWARGS["in_features"], n_classes=MLP_KWARGS["n_classes"])
    teacher = teacher_weights(seed=seed, **sizes)
    for step, batch in enumerate(teacher_batches(batch_size=64, seed=seed, **sizes)):
        if step == BAD_STEP:
            # One corrupted record: features in the wrong unit, label the teacher's least likely class.
            batch["x"][0] *= 100.0
            batch["y"][0] = (batch["x"][0] @ teacher).argmin()
        yield batch


def run(out_dir: str | Path, steps: int | None = None, progress: Progress | None = None, *, seed: int = 0) -> Path:
    """Train an MLP classifier with the hand-written NLL under FP16 and GradScaler; return the run dir."""
    torch.manual_seed(seed)
    model = models.build_mlp(**MLP_KWARGS)
    return train(
        out_dir, name="log_zero", model=model, factory=f"{models.__name__}:build_mlp", factory_kwargs=MLP_KWARGS,
        loss_fn=models.mlp_nll_loss, batches=_batches(seed), steps=steps or STEPS,
        amp_dtype=torch.float16, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
        use_scaler=True, progress=progress,
    )


if __name__ == "__main__":
    main(run, __doc__, default_steps=STEPS)

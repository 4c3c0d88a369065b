"""Small real runs for the autopsy tests: an FP32 MLP whose target holds an inf at one step.

Recorded in well under a second with the real Recorder (``tests.recorders.models``), so the
command-line tests (JSON, output files, bad input) need none of the slow sample scenarios.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["INF_STEP", "record_inf_target_run"]

INF_STEP = 2  # the step whose target holds the inf: the loss is inf there, the recorder snapshots it


def record_inf_target_run(run_dir: Path) -> Path:
    """Train ``build_mlp`` for 4 steps with ``y[0, 0] = inf`` at INF_STEP; return the run directory."""
    from recorders import Recorder
    from tests.recorders.models import batches, build_mlp, train

    model = build_mlp()
    data = batches(4)
    data[INF_STEP]["y"][0, 0] = float("inf")
    with Recorder(run_dir, model, factory="tests.recorders.models:build_mlp",
                  loss_fn="tests.recorders.models:mse_loss") as rec:
        train(model, data, rec=rec)
    return Path(run_dir)

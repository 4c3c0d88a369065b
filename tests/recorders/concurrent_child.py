"""One of two processes that record rank 0 of the same run directory at the same time.

Run as ``python -m tests.recorders.concurrent_child RUN_DIR SYNC_DIR NAME SEED STEPS``. Both
children build their Recorder, then wait for each other, so both are alive when the second
claims the rank; each trains with its own seed and writes its losses and warnings to
``SYNC_DIR/NAME.json``.
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

from recorders import Recorder
from recorders.recorder import RecorderWarning
from tests.recorders.models import batches, build_mlp, train


def _wait_for(sync: Path, suffix: str, n: int = 2, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(list(sync.glob(f"*.{suffix}"))) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other process never reached {suffix}")
        time.sleep(0.02)


def main(run_dir: str, sync_dir: str, name: str, seed: int, steps: int) -> None:
    torch.set_num_threads(1)
    sync = Path(sync_dir)
    model = build_mlp(seed=seed)
    data = batches(steps, seed=seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = Recorder(run_dir, model, factory="tests.recorders.models:build_mlp",
                       loss_fn="tests.recorders.models:mse_loss", flush_every=1)
        (sync / f"{name}.ready").touch()
        _wait_for(sync, "ready")
        losses = train(model, data, rec=rec)
        (sync / f"{name}.done").touch()
        _wait_for(sync, "done")
        rec.close()
    out = {"pid": os.getpid(), "writer": rec.writer, "losses": losses,
           "warnings": [str(w.message) for w in caught if issubclass(w.category, RecorderWarning)]}
    (sync / f"{name}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))

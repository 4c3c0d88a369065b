"""How far each sample scenario's finite replayed steps are from FP32, in eps (the precision_error tolerance).

Trains every sample scenario (samples/), replays each snapshot, and prints, for each step whose runs are
all finite, the loss and whole-gradient error of the low precision against FP32 in units of the dtype's
eps, beside the tolerance (analyzer/replay/_compare.py). Run: python bench/fp32_tolerance.py [OUT_DIR]
"""
from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

from analyzer.replay import Replay
from analyzer.replay._compare import GRAD_K, LOSS_K, compare
from samples._common import snapshots_of

SCENARIOS = ("healthy", "stalled_layers", "loss_outside_autocast", "fp16_attention_overflow", "bf16_nan",
             "masked_padding", "custom_op_outside_autocast", "log_zero")


def main(out: Path) -> None:
    print(f"tolerance: loss {LOSS_K:g} eps, whole gradient {GRAD_K:g} eps")
    for name in SCENARIOS:
        run_dir = importlib.import_module(f"samples.{name}").run(out / name)
        for snap in snapshots_of(run_dir):
            r = Replay(snap, device="cpu").run()
            low = r.precision_dtype
            c = compare(r.traces[low], r.traces["float32"]) if low in r.traces else None
            if c is None:
                print(f"{name:28s} {snap.name:40s} {r.verdict:16s} not all finite")
                continue
            print(f"{name:28s} {snap.name:40s} {r.verdict:16s} {low:9s} loss {c.loss_eps:7.3f} eps  "
                  f"grad {c.grad_eps:7.3f} eps  cos {c.grad_cosine:.6f}  worst param {c.worst[0]['param']} "
                  f"{c.worst[0]['rel'] / c.eps:.2f} eps")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))

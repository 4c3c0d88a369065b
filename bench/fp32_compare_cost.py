"""What comparing a finite step with FP32 costs beside the two runs replay already makes.

For one snapshot, alternates N times: the replay's FP32 run and low-precision run (``run_once``), then
``_compare.compare`` on their traces; prints the medians and their ratio. Run:
python bench/fp32_compare_cost.py SNAPSHOT [N]
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
import time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # samples/ and tests/ from a checkout

from analyzer.replay import Replay
from analyzer.replay.detection._compare import compare
from analyzer.replay.runs._runs import run_once


def main(path: str, n: int = 7) -> None:
    replay = Replay(path, device="cpu")
    ctx = replay.context()
    low, scale = ctx.mode.dtype, float(replay.snapshot.scale or 1.0)
    runs_s, cmp_s = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        fp32 = run_once(ctx, "float32", scale)
        lo = run_once(ctx, low, scale)
        t1 = time.perf_counter()
        compare(lo, fp32)
        t2 = time.perf_counter()
        runs_s.append(t1 - t0)
        cmp_s.append(t2 - t1)
    r, c = statistics.median(runs_s), statistics.median(cmp_s)
    params = sum(g.numel() for g in (fp32.grads or {}).values())
    print(f"{path}: {params} gradient elements; FP32 + {low} runs {r * 1e3:.1f} ms, compare {c * 1e3:.2f} ms "
          f"(median of {n}); compare / runs = {c / r:.3f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 7)

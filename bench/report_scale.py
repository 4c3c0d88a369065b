"""How ``analyzer report --json`` scales: a 1M-step x 100-layer trace (100M per-layer rows).

Generates a synthetic run directory in Parquet parts (vectorised, one chunk of steps at a
time, so generation itself stays small in memory), then times, interleaved A, B, C, A, B, C, ...:

- A: ``analyzer report RUN --json`` (the click command) as a subprocess;
- B: a plain polars scan-and-aggregate of the same files reading the columns the report reads
  (every step column; the layer columns step, rank, layer, grad_norm, grad_zero_frac,
  param_norm, update_rms, unchanged_frac), one aggregate per column per rank / per layer,
  streaming, also as a subprocess: the floor any reader of that data pays;
- C: the narrower scan this script timed first (three step columns; layer, grad_norm and
  grad_zero_frac of the layers), kept for comparison with older numbers.

Each variant runs under a tiny wrapper process, so ``resource.getrusage(RUSAGE_CHILDREN)``
gives that one run's peak RSS. Prints medians over the rounds of each variant's time and of its
per-round ratio to B (and of A's to C), for the whole process and for the time after imports
(the interpreter's start and the imports of polars and ``analyzer.report``, which imports
neither torch nor scipy). Targets: A within 2x of B, whole process; peak RSS < 1 GB.

Usage:
    python bench/report_scale.py                 # 1M steps x 100 layers (needs ~2 GB in /tmp)
    python bench/report_scale.py --quick         # 20k steps x 20 layers, a smoke run
    python bench/report_scale.py --steps 200000 --layers 50 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recorders import schema  # noqa: E402

_WRAPPER = r"""
import resource, subprocess, sys, time
t = time.perf_counter()
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
dt = time.perf_counter() - t
if rc.returncode:
    sys.stderr.write(rc.stderr[-2000:]); sys.exit(rc.returncode)
inner = rc.stderr.strip().splitlines()[-1].removeprefix("inner=")
print(dt, inner, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""

# `analyzer report RUN --json` through the real click command; the time after imports goes to stderr
_REPORT = r"""
import sys, time
import analyzer.report  # noqa: F401 - imported before the clock starts (the command imports it lazily)
from analyzer.cli import main
t = time.perf_counter()
try:
    main(["report", sys.argv[1], "--json"], standalone_mode=False)
finally:
    print(f"inner={time.perf_counter() - t}", file=sys.stderr)
"""

# B: the columns the report reads (frames.py: the step table and the per-layer aggregate), one
# aggregate each, grouped by rank / layer: what the report must at least decode and reduce
_RAW_COLUMNS = r"""
import sys, time, polars as pl
t = time.perf_counter()
run = sys.argv[1]
steps = pl.scan_parquet(f"{run}/trace/steps-r*-p*.parquet")
layers = pl.scan_parquet(f"{run}/trace/layers-r*-p*.parquet")
a = steps.group_by("rank").agg(pl.len(), pl.col("step").min(), pl.col("wall_time").max(), pl.col("loss").mean(),
                               pl.col("loss_dtype").first(), pl.col("scale").min(), pl.col("skipped").sum(),
                               pl.col("grad_norm").max(), pl.col("lr").first(), pl.col("nonfinite_grads").sum())
b = layers.group_by("layer").agg(pl.len(), pl.col("step").max(), pl.col("rank").min(),
                                 pl.col("grad_norm").log10().mean(), pl.col("grad_zero_frac").mean(),
                                 pl.col("param_norm").mean(), pl.col("update_rms").mean(),
                                 pl.col("unchanged_frac").mean())
a, b = a.collect(engine="streaming"), b.collect(engine="streaming")
print(a.height, b.height)
print(f"inner={time.perf_counter() - t}", file=sys.stderr)
"""

# C: the narrower scan first used as the floor (3 step columns, 3 layer columns)
_RAW = r"""
import sys, time, polars as pl
t = time.perf_counter()
run = sys.argv[1]
steps = pl.scan_parquet(f"{run}/trace/steps-r*-p*.parquet")
layers = pl.scan_parquet(f"{run}/trace/layers-r*-p*.parquet")
a = steps.group_by("rank").agg(pl.len(), pl.col("loss").mean(), pl.col("skipped").sum()).collect(engine="streaming")
b = layers.group_by("layer").agg(pl.col("grad_norm").log10().mean(), pl.col("grad_zero_frac").mean(),
                                 pl.len()).collect(engine="streaming")
print(a.height, b.height)
print(f"inner={time.perf_counter() - t}", file=sys.stderr)
"""


def generate(run: Path, n_steps: int, n_layers: int, chunk: int, ranks: int = 1) -> None:
    """Write meta(-rNNNNN).json and steps/layers parts of `chunk` steps each per rank (FP16, scaler)."""
    for rank in range(ranks):
        _generate_rank(run, n_steps, n_layers, chunk, rank, ranks)
    print(file=sys.stderr)


def _generate_rank(run: Path, n_steps: int, n_layers: int, chunk: int, rank: int, ranks: int) -> None:
    rng = np.random.default_rng(rank)
    (run / schema.TRACE_DIR).mkdir(parents=True, exist_ok=True)
    params = [{"name": f"blocks.{i // 2}.{'weight' if i % 2 == 0 else 'bias'}", "shape": [64, 64],
               "numel": 4096, "dtype": "float32", "depth": i} for i in range(n_layers)]
    meta = {"format": schema.META_FORMAT, "format_version": schema.FORMAT_VERSION, "torch_version": "bench",
            "amp_autopsy_version": "bench", "created": time.time(), "host": "bench", "pid": 0, "rank": rank,
            "world_size": ranks, "device_type": "cpu", "amp_dtype": "float16",
            "scaler": {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "init_scale": 65536.0},
            "params": params, "buffers": [], "factory": None, "factory_kwargs": {}, "loss_fn": None,
            "layer_every": 1, "flush_every": chunk}
    (run / schema.meta_name(rank)).write_text(json.dumps(meta))
    base = rng.normal(-1.5, 0.3, n_layers).astype(np.float32)
    for p, s0 in enumerate(range(0, n_steps, chunk)):
        n = min(chunk, n_steps - s0)
        step = np.arange(s0, s0 + n, dtype=np.int64)
        # one overflow per growth interval: healthy. The same steps on every rank, as in a real run
        # (GradScaler all-reduces found_inf): independent draws would merge into a skip on most steps
        skipped = np.random.default_rng([s0, n]).random(n) < 1 / 2000
        steps = pl.DataFrame({
            "step": step, "rank": np.full(n, rank, np.int32), "wall_time": 1.7e9 + step * 0.1,
            "loss": (3 * np.exp(-step / 2e5) + 1) * rng.lognormal(0, 0.03, n),
            "loss_dtype": np.full(n, "float32"), "scale": np.full(n, 32768.0), "skipped": skipped,
            "grad_norm": rng.lognormal(0, 0.1, n), "lr": np.full(n, 1e-4),
            "nonfinite_grads": np.where(skipped, 5, 0).astype(np.int64)}, schema=schema.STEP_COLUMNS)
        steps.write_parquet(run / schema.TRACE_DIR / schema.part_name("steps", rank, p))
        m = n * n_layers
        lg = base[None, :] + rng.normal(0, 0.1, (n, n_layers)).astype(np.float32)
        layers = pl.DataFrame({
            "step": np.repeat(step, n_layers), "rank": np.full(m, rank, np.int32),
            "layer": np.tile(np.arange(n_layers, dtype=np.int32), n),
            "grad_norm": (10.0 ** lg).ravel().astype(np.float32),
            "param_norm": np.tile(rng.uniform(1, 5, n_layers).astype(np.float32), n),
            "grad_nonfinite": np.zeros(m, np.int64),
            "grad_zero_frac": np.full(m, 0.001, np.float32),
            "update_rms": np.full(m, 1e-4, np.float32), "unchanged_frac": np.full(m, 0.01, np.float32)},
            schema=schema.LAYER_COLUMNS)
        layers.write_parquet(run / schema.TRACE_DIR / schema.part_name("layers", rank, p))
        print(f"\r  rank {rank}: wrote part {p} (steps {s0}..{s0 + n - 1})", end="", file=sys.stderr, flush=True)


def measure(cmd: list[str]) -> tuple[float, float, float]:
    """(wall s, s after imports, peak RSS MiB) of one run of `cmd`, in a wrapper so the peak is this run's."""
    out = subprocess.run([sys.executable, "-c", _WRAPPER, *cmd], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{out.stderr}")
    wall, inner, rss_kib = out.stdout.split()
    return float(wall), float(inner), int(rss_kib) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--layers", type=int, default=100)
    ap.add_argument("--chunk", type=int, default=50_000, help="steps per Parquet part")
    ap.add_argument("--ranks", type=int, default=1, help="ranks, each with --steps steps")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="20k steps x 20 layers, 2 repeats")
    ap.add_argument("--dir", type=Path, default=None, help="reuse/keep the generated run here")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.layers, args.chunk, args.repeats = 20_000, 20, 5_000, 2

    tmp_root = Path(args.dir or tempfile.mkdtemp(prefix="amp-autopsy-bench-"))
    free = shutil.disk_usage(tmp_root if tmp_root.exists() else tmp_root.parent).free
    rows = args.steps * args.layers * args.ranks
    need = rows * 20  # ~20 bytes per compressed layer row, generously
    print(f"disk: {free / 2**30:.1f} GiB free in {tmp_root}, need ~{need / 2**30:.2f} GiB")
    if free < 2 * need:
        raise SystemExit("not enough free disk: pass --steps/--layers smaller or --dir elsewhere")
    run = tmp_root / f"run-{args.steps}x{args.layers}" if args.ranks == 1 else \
        tmp_root / f"run-{args.ranks}r-{args.steps}x{args.layers}"
    try:
        if not (run / schema.META_FILE).exists():
            t = time.perf_counter()
            generate(run, args.steps, args.layers, args.chunk, args.ranks)
            print(f"generated {args.ranks} rank(s) x {args.steps:,} steps x {args.layers} layers = {rows:,} "
                  f"layer rows in {time.perf_counter() - t:.1f}s")
        size = sum(f.stat().st_size for f in (run / schema.TRACE_DIR).iterdir())
        print(f"trace: {size / 2**20:.0f} MiB on disk in {len(list((run / schema.TRACE_DIR).iterdir()))} parts")
        cmds = {"analyzer report --json": [sys.executable, "-c", _REPORT, str(run)],
                "raw polars scan+agg, the report's columns": [sys.executable, "-c", _RAW_COLUMNS, str(run)],
                "raw polars scan+agg, 6 columns (the first floor)": [sys.executable, "-c", _RAW, str(run)]}
        names = list(cmds)
        res: dict[str, list[tuple[float, float, float]]] = {k: [] for k in names}
        for i in range(args.repeats):  # interleaved: A, B, C, A, B, C, ...
            for k in names:
                res[k].append(measure(cmds[k]))
            print(f"  round {i + 1}: " + ", ".join(f"{k} {v[-1][0]:.2f}s" for k, v in res.items()), file=sys.stderr)

        def ratio(k: str, floor: str, j: int) -> float:  # median over the rounds of this round's ratio
            return statistics.median(a[j] / b[j] for a, b in zip(res[k], res[floor]))

        print(f"\n{args.ranks} rank(s) x {args.steps:,} steps x {args.layers} layers ({rows:,} layer rows, "
              f"{size / 2**20:.0f} MiB of Parquet), medians of {args.repeats} interleaved rounds; ratios are "
              f"medians of per-round ratios to the report's-columns scan")
        print("| variant | wall time, process (s) | ratio | time after imports (s) | ratio | peak RSS (MiB) |")
        print("|---|---|---|---|---|---|")
        for k, v in res.items():
            print(f"| {k} | {statistics.median(w for w, _, _ in v):.2f} | {ratio(k, names[1], 0):.2f}x "
                  f"| {statistics.median(t for _, t, _ in v):.2f} | {ratio(k, names[1], 1):.2f}x "
                  f"| {max(m for _, _, m in v):.0f} |")
        print(f"analyzer report --json against the first floor: {ratio(names[0], names[2], 0):.2f}x whole process, "
              f"{ratio(names[0], names[2], 1):.2f}x after imports")
    finally:
        if args.dir is None:
            shutil.rmtree(tmp_root, ignore_errors=True)


if __name__ == "__main__":
    main()

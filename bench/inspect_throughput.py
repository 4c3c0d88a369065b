"""Throughput of ``analyzer inspect`` against the floor: ``torch.load(mmap=True)`` + a sum over all tensors.

Writes a synthetic training checkpoint (weights, Adam exp_avg and exp_avg_sq in equal parts, all in
``--dtype``, float32 by default, so both the fast path and the flush-to-zero counting path run) into a temporary directory, runs
the variants interleaved, prints medians and ratios from the same run, then deletes the file.

Variants: the floor; ``analyzer inspect`` with its default scan (the compiled one, ``analyzer/_scan.c``,
when it was built); and, when that is the compiled one, ``analyzer inspect`` with the numpy scan, the
fallback for installs without a C compiler.

Each variant runs on one thread and on ``--threads`` threads (default 2): the floor's sum through
``torch.set_num_threads``, the scan through ``Workspace(threads=...)``. Ratios are given against
the one-thread floor and against the floor on the same number of threads.

    python bench/inspect_throughput.py             # ~2 GB, 5 rounds
    python bench/inspect_throughput.py --quick     # ~0.25 GB, 3 rounds
    python bench/inspect_throughput.py --per-kind  # also the kernel alone on weights, exp_avg, exp_avg_sq
    python bench/inspect_throughput.py --dtype bfloat16  # every tensor bf16 (the kernel's 16-bit path)
    python bench/inspect_throughput.py --pair      # two checkpoints: inspect A B against summing both

NB: by default the file is in the page cache (it was just written), so this measures scanning, not
the disk. ``--cold`` evicts this one file's pages (``posix_fadvise(DONTNEED)``, nothing else) before
every run, so both variants read from disk, as they do for a checkpoint that was written hours ago.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from analyzer import _tensorstats
from analyzer.inspect import inspect_checkpoints

TENSOR_ELEMS = 8 << 20  # 32 MiB of float32 per tensor


def write_checkpoint(path: Path, size_gb: float, dtype: torch.dtype = torch.float32, seed: int = 0) -> int:
    """A {"model": ..., "optimizer": ...} checkpoint of about size_gb, built one tensor at a time."""
    item = torch.empty((), dtype=dtype).element_size()
    n = max(3, round(size_gb * 1e9 / (TENSOR_ELEMS * item) / 3) * 3)
    g = torch.Generator().manual_seed(seed)
    params = n // 3
    model = {f"layers.{i}.weight": torch.randn(TENSOR_ELEMS, generator=g).mul_(0.02).view(2048, -1).to(dtype)
             for i in range(params)}
    state = {}
    for i in range(params):  # Adam after some steps: small first moments, tiny second moments
        grad = torch.randn(TENSOR_ELEMS, generator=g).mul_(1e-4).view(2048, -1)
        state[i] = {"step": torch.tensor(100.0), "exp_avg": grad.to(dtype),
                    "exp_avg_sq": grad.square().mul_(0.01).to(dtype)}
    opt = {"state": state, "param_groups": [{"params": list(range(params)), "lr": 1e-3}]}
    torch.save({"model": model, "optimizer": opt, "step": 100}, path)
    return n * TENSOR_ELEMS * item


def floor(paths: list[Path], threads: int) -> None:
    torch.set_num_threads(threads)
    total = 0.0
    for path in paths:
        sd = torch.load(path, mmap=True, weights_only=True)
        for t in sd["model"].values():
            total += float(t.sum())
        for slots in sd["optimizer"]["state"].values():
            for t in slots.values():
                total += float(t.sum())


def inspect(paths: list[Path], threads: int, kernel: str = _tensorstats.KERNEL) -> None:
    torch.set_num_threads(threads)  # what Workspace() takes as its thread count
    default, _tensorstats.KERNEL = _tensorstats.KERNEL, kernel  # what Workspace() takes as its kernel
    try:
        result = inspect_checkpoints(*paths)
    finally:
        _tensorstats.KERNEL = default
    assert not [f for f in result.findings if f.severity == "error"], "the synthetic checkpoint is healthy"


def inspect_numpy(paths: list[Path], threads: int) -> None:
    inspect(paths, threads, "numpy")


def per_kind(path: Path, rounds: int) -> None:
    """The compiled kernel alone, called per tensor on one thread, against a sum of the same tensors."""
    from analyzer import _rangestats
    if not _rangestats.compiled():
        print("per kind: analyzer._scan is not built, nothing to measure")
        return
    torch.set_num_threads(1)
    kinds = {"weights": lambda sd: sd["model"].values(),
             "exp_avg": lambda sd: [s["exp_avg"] for s in sd["optimizer"]["state"].values()],
             "exp_avg_sq": lambda sd: [s["exp_avg_sq"] for s in sd["optimizer"]["state"].values()]}

    def run(pick, scan: bool) -> float:
        sd = torch.load(path, mmap=True, weights_only=True)
        t = time.perf_counter()
        for x in pick(sd):
            if scan:
                flat = x.reshape(-1)
                kind = _tensorstats._KERNEL_KIND[flat.dtype]
                view = flat.numpy() if kind == "f32" else flat.view(torch.int16).numpy()
                getattr(_rangestats._scan, f"scan_{kind}")(view, *_rangestats._KERNEL_LIMITS)
            else:
                float(x.sum())
        return time.perf_counter() - t

    for kind, pick in kinds.items():
        times = {False: [], True: []}
        for _ in range(rounds):
            for scan in (False, True):
                times[scan].append(run(pick, scan))
        ratio = statistics.median(times[True]) / statistics.median(times[False])
        print(f"per kind, kernel alone vs sum, 1 thread: {kind:10} {ratio:.2f}x")


def evict(path: Path) -> None:
    """Drop this file's pages from the page cache (Linux; a no-op elsewhere)."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size (default 2)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    ap.add_argument("--threads", type=int, default=2, help="the second thread count to run both at (default 2)")
    ap.add_argument("--quick", action="store_true", help="0.25 GB and 3 rounds")
    ap.add_argument("--cold", action="store_true", help="evict the file from the page cache before every run")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="dtype of every tensor in the checkpoint (default float32)")
    ap.add_argument("--pair", action="store_true",
                    help="write a second checkpoint (another seed) and inspect A against B; the floor sums both")
    ap.add_argument("--per-kind", action="store_true",
                    help="also time the compiled kernel alone on each kind of tensor (1 thread)")
    ap.add_argument("--dir", default=None, help="where to write the temporary checkpoint (default: $TMPDIR)")
    args = ap.parse_args()
    if args.quick:
        args.size_gb, args.rounds = 0.25, 3
    threads = sorted({1, args.threads})
    tmp = Path(tempfile.mkdtemp(prefix="inspect-bench-", dir=args.dir))
    try:
        path = tmp / "ckpt.pt"
        t0 = time.perf_counter()
        nbytes = write_checkpoint(path, args.size_gb, getattr(torch, args.dtype))
        paths = [path]
        if args.pair:
            paths.append(tmp / "ckpt_b.pt")
            nbytes += write_checkpoint(paths[1], args.size_gb, getattr(torch, args.dtype), seed=1)
        print(f"wrote {nbytes / 1e9:.2f} GB of {args.dtype} tensors in {len(paths)} file(s) "
              f"in {time.perf_counter() - t0:.1f} s; {args.rounds} rounds, "
              f"{'cold (evicted before each run)' if args.cold else 'warm page cache'}; "
              f"default scan: {_tensorstats.KERNEL!r}; numpy scan chunks {_tensorstats.CHUNK} elements, "
              f"{_tensorstats.THREAD_CHUNK} in a tensor split between threads")
        named = [("floor: torch.load(mmap) + sum", floor), (f"analyzer inspect ({_tensorstats.KERNEL})", inspect)]
        if _tensorstats.KERNEL == "c":  # the fallback for installs without a C compiler, measured alongside
            named.append(("analyzer inspect (numpy)", inspect_numpy))
        variants = {(name, n): fn for n in threads for name, fn in named}
        times: dict[tuple[str, int], list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for (name, n), fn in variants.items():  # interleaved, so machine noise hits all alike
                if args.cold:
                    for p in paths:
                        evict(p)
                t = time.perf_counter()
                fn(paths, n)
                times[name, n].append(time.perf_counter() - t)
        med = {k: statistics.median(ts) for k, ts in times.items()}
        base = med["floor: torch.load(mmap) + sum", 1]
        print(f"{'variant':32} {'threads':>7} {'median s':>9} {'GB/s':>7} {'vs floor@1':>11} "
              f"{'vs floor@same':>14}   (min .. max s)")
        for (name, n), ts in times.items():
            m = med[name, n]
            same = m / med["floor: torch.load(mmap) + sum", n]
            print(f"{name:32} {n:7} {m:9.3f} {nbytes / m / 1e9:7.2f} {m / base:10.2f}x {same:13.2f}x   "
                  f"({min(ts):.3f} .. {max(ts):.3f})")
        if args.per_kind:
            per_kind(path, args.rounds)
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()

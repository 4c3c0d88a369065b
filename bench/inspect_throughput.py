"""Throughput of ``analyzer inspect`` against the floor: ``torch.load(mmap=True)`` + a sum over all tensors.

Writes a synthetic training checkpoint (weights, Adam exp_avg and exp_avg_sq in equal parts, all in
``--dtype``, float32 by default, so both the healthy path and the flush-to-zero counting path run) into a
temporary directory, runs the variants interleaved, prints medians and ratios from the same run, then
deletes the file.

Variants: the floor, and ``analyzer inspect`` (the torch scan of ``analyzer/inspect/_scan.py``), each on
one thread and on ``--threads`` threads (``torch.set_num_threads``; default 2); with ``--device cuda``
also the scan on the GPU. Ratios are against the floor on the same number of threads. Two more variants
take inspect apart: the scan alone (``torch.load(mmap=True)`` and ``_scan.scan_all`` over every tensor, on
each thread count), and, on one thread, the CRC-32 check (``load.torchfile.check_crcs``) that
``analyzer inspect`` runs on the file before loading it. Inspect's time is about the two together.

    python bench/inspect_throughput.py                       # 1 GB float32, 5 rounds
    python bench/inspect_throughput.py --dtype bfloat16      # every tensor bf16
    python bench/inspect_throughput.py --cold                # read from disk every run
    python bench/inspect_throughput.py --pair                # two checkpoints: inspect A B against summing both
    python bench/inspect_throughput.py --chunk 1048576       # another chunk size (elements)

NB: by default the file is in the page cache (it was just written), so this measures scanning, not
the disk. How its pages got there matters to the floor: pages torch.save wrote, or that read() brought
back, map in few page faults, while pages first read through mmap faults cost the floor about as much
again in faults; ``--reread mmap|read`` evicts the file and reads it back that way first.
``--cold`` evicts this one file's pages (``posix_fadvise(DONTNEED)`` after ``fsync``, nothing else)
before every run of every variant, so both read from disk, as they do for a checkpoint written hours
ago; ``--cold`` also times a plain ``read()`` of the file, the disk's own speed, and inspect taking the
two other orders a cold file could take instead of streaming it (``load/_stream.py``: one reader,
the scan following it): the check first and then the scan, or the check forced beside the scan (the
page-cache path). ``--cold-reader`` (4 GB by default) times only inspect's streamed read of a cold file
against plain synchronous reads without that machinery (a ``zipfile`` read of every record, which checks
its CRC-32, then the scan; the in-place check of every record first; the check as ``torch_load_safe``
caps it), the file evicted and probed cold with inspect's own ``mincore`` probe before every run.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from analyzer.inspect import _scan, inspect_checkpoints
from analyzer.load import _stream, torchfile
from analyzer.load.torchfile import check_crcs

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


def tensors(path: Path) -> list[torch.Tensor]:
    """Every tensor of a checkpoint written by write_checkpoint, loaded with mmap."""
    sd = torch.load(path, mmap=True, weights_only=True)
    return [*sd["model"].values(), *(t for slots in sd["optimizer"]["state"].values() for t in slots.values())]


def floor(paths: list[Path], threads: int) -> None:
    torch.set_num_threads(threads)
    total = 0.0
    for path in paths:
        for t in tensors(path):
            total += float(t.sum())


def scan_alone(paths: list[Path], threads: int) -> None:
    """The scan without inspect's loader (no CRC-32 check, no archive bounds) and without the diagnosis;
    with --pair, A's tensors against B's, as ``inspect A B`` scans them."""
    torch.set_num_threads(threads)
    if len(paths) == 2:
        _scan.scan_all(list(zip(tensors(paths[0]), tensors(paths[1]))))
        return
    for path in paths:
        _scan.scan_all([(t, None) for t in tensors(path)])


def inspect(paths: list[Path], threads: int, device: str = "cpu") -> None:
    torch.set_num_threads(threads)
    result = inspect_checkpoints(*paths, device=device)
    assert result.files[0].tensors


@contextlib.contextmanager
def _set(module, **values):
    """`module`'s attributes set to `values` inside, restored after: inspect with one part of its reader changed."""
    before = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(module, name, value)


def inspect_check_beside(paths: list[Path], threads: int) -> None:
    """--cold: inspect with the CRC-32 check beside the scan, as for a file in the page cache, instead of first."""
    with _set(torchfile, _in_page_cache=lambda path: True):
        inspect(paths, threads)


def inspect_check_first(paths: list[Path], threads: int) -> None:
    """--cold: inspect with the CRC-32 check first, then the scan, instead of streaming the file."""
    with _set(_stream, STREAM_MIN_BYTES=1 << 62):
        inspect(paths, threads)


def inspect_plain_all(paths: list[Path], threads: int) -> None:
    """--cold-reader: the check first, as ``inspect_check_first``, with every record's CRC-32 checked
    whatever the file's size (the streamed read checks them all in passing)."""
    with _set(torchfile, CRC_FULL_BYTES=1 << 62):
        inspect_check_first(paths, threads)


def inspect_plain_zipfile(paths: list[Path], threads: int) -> None:
    """--cold-reader: the plain synchronous read: every record read through ``zipfile`` front to back, which
    checks its CRC-32 (stdlib zlib), then the scan of the file now in the page cache, with no second check."""
    for path in paths:
        with zipfile.ZipFile(path) as zf:
            for info in sorted(zf.infolist(), key=lambda i: i.header_offset):
                with zf.open(info) as f:
                    while f.read(8 << 20):
                        pass
    with _set(torchfile, _crc_verdict=lambda path, names=None: (None, 0)), _set(_stream, STREAM_MIN_BYTES=1 << 62):
        inspect(paths, threads)


def cold_reader(path: Path, rounds: int) -> None:
    """--cold-reader: inspect's streamed read of a cold file against the plain synchronous read (the
    CRC-32 check through zipfile first, then the scan), in rotating order, the file evicted before every
    run and checked cold with inspect's own mincore probe."""
    variants = {"inspect, streamed (load/_stream.py)": inspect,
                "inspect, plain: check first (as capped)": inspect_check_first,
                "inspect, plain: check first (every record)": inspect_plain_all,
                "inspect, plain: zipfile read, then scan": inspect_plain_zipfile,
                "read() of the file": read_file}
    names = list(variants)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each variant first in turn
            evict(path)
            if torchfile._in_page_cache(path, enough=0.05):
                raise SystemExit(f"{path} is still in the page cache after eviction: not a cold run")
            t = time.perf_counter()
            variants[name]([path], 1)
            times[name].append(time.perf_counter() - t)
    stream = times[names[0]]
    print(f"{'variant':44} {'median s':>9} {'fastest s':>9}   streamed / this per round: median (min .. max)")
    for name, ts in times.items():
        ratios = [a / b for a, b in zip(stream, ts)]
        print(f"{name:44} {statistics.median(ts):9.3f} {min(ts):9.3f}   "
              f"{statistics.median(ratios):.2f}x ({min(ratios):.2f} .. {max(ratios):.2f})")
    for name, ts in times.items():
        print(f"  {name}: " + " ".join(f"{t:.2f}" for t in ts))
    for name in names[1:4]:
        ratios = [a / b for a, b in zip(stream, times[name])]
        print(f"the streamed read saves {1 - statistics.median(stream) / statistics.median(times[name]):.0%} of "
              f"'{name}' (medians), {1 - statistics.median(ratios):.0%} (median of per-round ratios), "
              f"{1 - min(stream) / min(times[name]):.0%} (fastest runs)")


def inspect_cuda(paths: list[Path], threads: int) -> None:
    inspect(paths, threads, "cuda")


def crc_check(paths: list[Path], threads: int) -> None:
    """The CRC-32 check inspect runs before loading: every record read through zipfile and checked."""
    for path in paths:
        check_crcs(path)


def read_file(paths: list[Path], threads: int) -> None:
    """The disk's speed: every byte read once, in 8 MiB blocks, nothing done with it."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            buf = bytearray(8 << 20)
            while f.readinto(buf):
                pass


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
    ap.add_argument("--size-gb", type=float, default=None, help="checkpoint size (default 1; --cold-reader: 4)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    ap.add_argument("--threads", type=int, default=2, help="the second thread count to run both at (default 2)")
    ap.add_argument("--quick", action="store_true", help="0.25 GB and 3 rounds")
    ap.add_argument("--cold", action="store_true", help="evict the file from the page cache before every run")
    ap.add_argument("--cold-reader", action="store_true",
                    help="only inspect's streamed read of a cold file against the plain synchronous read "
                    "(check first, then scan), the file evicted and probed cold before every run (default 4 GB)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="dtype of every tensor in the checkpoint (default float32)")
    ap.add_argument("--pair", action="store_true",
                    help="write a second checkpoint (another seed) and inspect A against B; the floor sums both")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: also time inspect --device cuda")
    ap.add_argument("--chunk", type=int, default=None, help=f"elements per CPU chunk (default {_scan.CHUNK})")
    ap.add_argument("--dir", default=None, help="where to write the temporary checkpoint (default: $TMPDIR)")
    ap.add_argument("--reread", choices=["mmap", "read"], default=None,
                    help="warm runs: first evict the file and read it back once, through mmap faults (as an "
                    "earlier inspect of a cold file leaves it) or read() (as cp or a plain read does), "
                    "instead of timing the pages torch.save left")
    args = ap.parse_args()
    if args.quick:
        args.size_gb, args.rounds = 0.25, 3
    if args.size_gb is None:
        args.size_gb = 4.0 if args.cold_reader else 1.0
    if args.chunk:
        _scan.CHUNK = args.chunk
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
        if args.reread and not args.cold:
            for p in paths:
                evict(p)
            (floor if args.reread == "mmap" else read_file)(paths, 1)
        warm = f"warm page cache ({f'read back through {args.reread}' if args.reread else 'as torch.save left it'})"
        print(f"wrote {nbytes / 1e9:.2f} GB of {args.dtype} tensors in {len(paths)} file(s) "
              f"in {time.perf_counter() - t0:.1f} s; {args.rounds} rounds, "
              f"{'cold (evicted before each run)' if args.cold or args.cold_reader else warm}; "
              f"chunk {_scan.CHUNK} elements; torch {torch.__version__}, "
              f"{torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs")
        if args.cold_reader:
            cold_reader(path, args.rounds)
            return
        floor_name = "floor: torch.load(mmap) + sum"
        named = [(floor_name, floor), ("analyzer inspect (cpu)", inspect),
                 ("scan alone: load(mmap) + scan", scan_alone)]
        if args.device == "cuda":
            named.append(("analyzer inspect (cuda)", inspect_cuda))
        variants = {(name, n): fn for n in threads for name, fn in named}
        variants["CRC-32 check (inside inspect)", 1] = crc_check
        if args.cold:
            variants["read() of the file", 1] = read_file
            variants["inspect, check first, then scan", 1] = inspect_check_first
            variants["inspect, check beside the scan", 1] = inspect_check_beside
        times: dict[tuple[str, int], list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for (name, n), fn in variants.items():  # interleaved, so machine noise hits all alike
                if args.cold:
                    for p in paths:
                        evict(p)
                t = time.perf_counter()
                fn(paths, n)
                times[name, n].append(time.perf_counter() - t)
        print(f"{'variant':32} {'threads':>7} {'median s':>9} {'GB/s':>7} {'vs floor':>9}   (ratio min .. max)")
        for (name, n), ts in times.items():
            m = statistics.median(ts)
            ratios = [t / f for t, f in zip(ts, times[floor_name, n])]  # each against its own round's floor
            print(f"{name:32} {n:7} {m:9.3f} {nbytes / m / 1e9:7.2f} {statistics.median(ratios):8.2f}x   "
                  f"({min(ratios):.2f} .. {max(ratios):.2f})")
        if args.cold:  # the limit from disk is against the disk's own speed
            disk = times["read() of the file", 1]
            # NB: a virtual disk can switch between two speeds for seconds at a time (3x apart, seen
            # here), which moves a median of ratios; the fastest run of each is the other view
            print("vs a read() of the file, 1 thread (medians of per-round ratios; "
                  "fastest run against fastest read): " + ", ".join(
                f"{name} {statistics.median(t / d for t, d in zip(times[name, 1], disk)):.2f}x"
                f" ({min(times[name, 1]) / min(disk):.2f}x)"
                for name in ("analyzer inspect (cpu)", "inspect, check first, then scan",
                             "inspect, check beside the scan", "scan alone: load(mmap) + scan", floor_name)))
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()

"""Peak memory per rank of the distributed replay (N = 2) against the one-process replay (N = 1), side by side.

One 2-rank FSDP2 run (gloo, CPU, BF16 ``param_dtype``) of an MLP whose parameters dominate
(``_replay_model.build``: ``--width`` x ``--width`` Linear layers, a batch of 2 rows) is recorded once:
at step 0 rank 1's batch holds a NaN (``--fault input``: the replay stops at ``nonfinite_input``) or a finite
3e38 that the first Linear overflows (``--fault op``: a NaN/Inf born in an ordinary op, so under torchrun every
rank also runs the one-process diagnosis and fixes in lockstep), so every rank snapshots that step into one
DCP directory. Then,
alternating for ``--rounds`` rounds, the same snapshot is replayed by

- ``N=1``: ``python -m analyzer replay SNAP`` (the whole model consolidated in one process);
- ``N=2``: ``torchrun --nproc-per-node 2 -m analyzer replay SNAP`` (each rank loads its shards);
- ``base``: a process that imports torch and the analyzer and replays nothing (the floor every process pays).

Each process writes its own peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``) at exit; the table gives, per
variant, the median over rounds of the largest rank's peak, and the same above the ``base`` floor. Every
process runs with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc's sliding threshold otherwise keeps freed tensors
of up to 32 MiB in per-thread arenas (gloo's threads among them), and RSS then grows with the allocator's
retention (2.2 GB per rank for this model under FSDP2), not with what the replay holds. The
parameters' FP32 bytes are printed beside them. NB: on a machine shared with other jobs the RSS numbers
do not move with the load, the wall times do.

Usage::

    python bench/distributed_replay_memory.py            # width 2048, depth 16 (256 MiB of FP32 parameters), 3 rounds
    python bench/distributed_replay_memory.py --quick        # a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))


def _record_rank(rank: int, world: int, init: str, run_dir: str, width: int, depth: int, fault: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import _replay_model as rm
    from recorders import Recorder

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    model = rm.build(width, depth)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    rec = Recorder(run_dir, model, factory=rm.build, factory_kwargs={"width": width, "depth": depth},
                   loss_fn=rm.loss_fn, amp_dtype=torch.bfloat16, sync_failures=True)
    with rec:
        g = torch.Generator().manual_seed(rank)
        batch = {"x": torch.randn(2, width, generator=g), "y": torch.randn(2, 1, generator=g)}
        if rank == 1:
            batch["x"][0, 0] = float("nan") if fault == "input" else 3e38
        rec.begin_step(0, batch)
        loss = rm.loss_fn(model, batch)
        loss.backward()
        rec.end_step(loss)
    dist.destroy_process_group()


def record(root: Path, width: int, depth: int, fault: str) -> Path:
    import torch.multiprocessing as mp

    root.mkdir(parents=True, exist_ok=True)
    mp.spawn(_record_rank, args=(2, f"file://{root}/rendezvous", str(root / "run"), width, depth, fault), nprocs=2)
    return next((root / "run" / "snapshots").glob("step00000000-r00001-*.pt"))


def worker(out_dir: str, args: list[str]) -> None:
    """One replay process (or the floor: ``base``): the analyzer's CLI in-process, then its peak RSS to a file."""
    code = 0
    leave = os._exit

    def record_then_leave(status: int) -> None:  # NB: under torchrun the CLI leaves with os._exit, past `finally`
        Path(out_dir, f"rss-{os.environ.get('RANK', '0')}.txt").write_text(
            str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
        leave(status)

    os._exit = record_then_leave
    try:
        if args != ["base"]:
            from analyzer.cli import main

            main(args, standalone_mode=False)
        else:
            import analyzer.replay  # noqa: F401 - the imports every replay process pays for
    except SystemExit as e:
        code = e.code or 0
    finally:
        rank = os.environ.get("RANK", "0")
        Path(out_dir, f"rss-{rank}.txt").write_text(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
    sys.exit(code)


def run_variant(variant: str, snap: Path, tmp: Path) -> tuple[float, float]:
    """(largest rank's peak RSS in MiB, wall seconds) of one process launch of `variant`."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    me = [str(Path(__file__).resolve()), "--worker", str(out)]
    replay = ["replay", str(snap), "--json", "--path", str(BENCH)]
    if variant == "N=2":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *me, *replay]
    else:
        cmd = [sys.executable, *me, *(["base"] if variant == "base" else replay)]
    # NB: a fixed mmap threshold: glibc's sliding one keeps freed blocks of up to 32 MiB in each thread's arena
    # (gloo runs threads), so without it RSS measures what the allocator kept, not what the replay held
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MALLOC_MMAP_THRESHOLD_="65536")
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{res.stderr[-3000:]}")
    peaks = [int(p.read_text()) / 1024 for p in out.glob("rss-*.txt")]  # ru_maxrss is KiB on Linux
    return max(peaks), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fault", choices=("input", "op"), default="input",
                    help="input: a NaN in rank 1's batch; op: a finite 3e38 the first Linear overflows")
    ap.add_argument("--quick", action="store_true", help="a smoke run: width 256, depth 2, 1 round")
    ap.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], a.worker[1:])
    if a.quick:
        a.width, a.depth, a.rounds = 256, 2, 1
    params = a.depth * (a.width * a.width + a.width) + a.width + 1
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        snap = record(tmp / "rec", a.width, a.depth, a.fault)
        variants = ("base", "N=1", "N=2")
        peaks: dict[str, list[float]] = {v: [] for v in variants}
        walls: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(a.rounds):
            for v in (variants if r % 2 == 0 else variants[::-1]):  # alternating order
                p, w = run_variant(v, snap, tmp)
                peaks[v].append(p)
                walls[v].append(w)
    med = {v: statistics.median(peaks[v]) for v in variants}
    floor = med["base"]
    print(f"model: {params / 1e6:.1f}M parameters, {params * 4 / 2**20:.0f} MiB in FP32; --fault {a.fault}; {a.rounds} round(s), "
          f"alternating; machine shared with other jobs: wall times are noisy, RSS is not")
    print("| variant | peak RSS per rank, largest rank (MiB) | above the floor (MiB) | wall (s) |")
    print("|---|---|---|---|")
    for v in variants:
        print(f"| {v} | {med[v]:.0f} | {med[v] - floor:.0f} | {statistics.median(walls[v]):.1f} |")
    one, two = med["N=1"] - floor, med["N=2"] - floor
    print(f"ratio above the floor: N=2 / N=1 = {two / one:.2f}" if one > 0 else "ratio above the floor: n/a")
    print(json.dumps({"params": params, "median_peak_mib": med}))


if __name__ == "__main__":
    main()

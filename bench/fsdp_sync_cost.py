"""Cost of ``Recorder(sync_failures=True)`` on a 2-rank FSDP2 run (gloo, CPU), side by side.

Each round trains the same ``fully_shard``-ed MLP (BF16 ``param_dtype``) for ``--steps`` healthy
steps three ways, in one process group, interleaved so that load from other processes hits them
alike: ``plain`` (no Recorder), ``local`` (a Recorder, ``sync_failures=False``) and ``synced``
(``sync_failures=True``: one tiny all-reduce of a failure flag per step). It prints the median
step time of ``plain`` and the medians of the per-round ratios.

Usage::

    python bench/fsdp_sync_cost.py                 # width 1024, 4 layers, 30 steps, 5 rounds
    python bench/fsdp_sync_cost.py --quick         # a smoke run
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("plain", "local", "synced")


def build(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def loss_fn(model, batch):
    return torch.nn.functional.mse_loss(model(batch["x"]).float(), batch["y"])


def _train(rank: int, args, variant: str, run_dir: str) -> float:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from recorders import Recorder

    model = build(args.width, args.depth)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rec = None
    if variant != "plain":
        rec = Recorder(run_dir, model, amp_dtype=torch.bfloat16, optimizer=opt,
                       sync_failures=variant == "synced", flush_every=50)
    g = torch.Generator().manual_seed(rank)
    batches = [{"x": torch.randn(args.batch, args.width, generator=g), "y": torch.randn(args.batch, 1, generator=g)}
               for _ in range(args.steps)]
    times = []
    for step, batch in enumerate(batches):
        dist.barrier()
        t0 = time.perf_counter()
        if rec is not None:
            rec.begin_step(step, batch)
        loss = loss_fn(model, batch)
        loss.backward()
        if rec is not None:
            rec.end_step(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if rec is not None:
        rec.close()
    return statistics.median(times[3:])  # the first steps warm up allocators and gloo


def _worker(rank: int, world: int, init: str, args, out: str) -> None:
    from datetime import timedelta

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    res: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for v in VARIANTS[r % 3:] + VARIANTS[:r % 3]:  # each variant leads a round in turn
                res[v].append(_train(rank, args, v, f"{tmp}/{v}{r}"))
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="width 64, 2 layers, 8 steps, 2 rounds")
    args = ap.parse_args()
    if args.quick:
        args.width, args.depth, args.steps, args.rounds = 64, 2, 8, 2
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/res.json"
        mp.spawn(_worker, args=(2, f"file://{tmp}/rdv", args, out), nprocs=2, join=True)
        res = json.loads(Path(out).read_text())
    plain = res["plain"]
    print(f"FSDP2, 2 ranks (gloo, CPU, 1 thread each), MLP width {args.width} x {args.depth}, batch {args.batch}, "
          f"{args.steps} steps x {args.rounds} rounds; medians of per-round ratios")
    print(f"  plain step          {statistics.median(plain) * 1e3:8.2f} ms")
    for v in ("local", "synced"):
        ratios = [a / b for a, b in zip(res[v], plain)]
        print(f"  {v:<8} / plain     {statistics.median(ratios):8.3f}x   (range {min(ratios):.3f}-{max(ratios):.3f})")
    syn = [a / b for a, b in zip(res["synced"], res["local"])]
    print(f"  synced / local      {statistics.median(syn):8.3f}x   (range {min(syn):.3f}-{max(syn):.3f})")


if __name__ == "__main__":
    main()

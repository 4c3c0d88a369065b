"""Cost of ``Recorder(rewind=K)`` per step and in memory, side by side with the Recorder without it.

An MLP (``--width``, ``--layers``; default ~0.26M parameters) trains in FP32 on CPU with Adam, three
copies of it from the same initial weights, each with its own optimizer: ``plain`` (no recorder),
``recorder`` (``Recorder()`` defaults) and ``rewind=K``. Every round times one block of K steps of each
variant (so each ``rewind`` block holds exactly one copy of the weights and optimizer state), in an
order that alternates between rounds, and the ratios are medians over rounds of (variant block / the
other block of the same round). After the rounds it prints what the window holds on the host (its two
starts and its batches, from the window itself) against the weights' own bytes, and the size of a
manual snapshot file with and without the window.

    python bench/rewind_cost.py               # ~0.26M params, batch 32, K=16, 31 rounds
    python bench/rewind_cost.py --width 640 --layers 8 --batch 64   # ~3.3M params
    python bench/rewind_cost.py --k 64        # a longer window: the copy every K steps is amortised more
    python bench/rewind_cost.py --quick       # tiny, 3 rounds (a smoke run)
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recorders import Recorder  # noqa: E402


def build(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*mods, nn.Linear(width, 1))


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]), batch["y"])


def _bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_bytes(v) for v in obj)
    return 0


class Variant:
    def __init__(self, name: str, model: nn.Module, run_dir: str | None, rewind: int | None):
        self.name, self.model = name, model
        self.opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        self.rec = None if run_dir is None else Recorder(run_dir, model, optimizer=self.opt, rewind=rewind,
                                                         loss_spike=None, grad_spike=None)
        self.step = 0
        self.own = 0.0  # seconds inside the window's begin_step copies (rewind only)
        window = getattr(self.rec, "_rewind", None)
        if window is not None:
            begin = window.begin

            def timed(*a):
                t = time.perf_counter()
                begin(*a)
                self.own += time.perf_counter() - t
            window.begin = timed

    def block(self, batches: list[dict]) -> float:
        t = time.perf_counter()
        for batch in batches:
            if self.rec is not None:
                self.rec.begin_step(self.step, batch)
            loss = loss_fn(self.model, batch)
            loss.backward()
            if self.rec is not None:
                self.rec.end_step(loss)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
        return time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.k, args.rounds = 64, 2, 4, 3
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(args.batch, args.width, generator=g), "y": torch.randn(args.batch, 1, generator=g)}
               for _ in range(args.k)]
    base = build(args.width, args.layers)
    n_params = sum(p.numel() for p in base.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        variants = [Variant("plain", copy.deepcopy(base), None, None),
                    Variant("recorder", copy.deepcopy(base), f"{tmp}/rec", None),
                    Variant(f"rewind={args.k}", copy.deepcopy(base), f"{tmp}/rewind", args.k)]
        for v in variants:  # warm-up: one block each (allocations, the window's first start and buffers)
            v.block(batches)
        times = {v.name: [] for v in variants}
        own = []  # the window's own time in a rewind block over the plain block of the same round
        for r in range(args.rounds):
            variants[2].own = 0.0
            for v in (variants if r % 2 == 0 else variants[::-1]):
                times[v.name].append(v.block(batches))
            own.append(variants[2].own / times["plain"][-1])
        rec, rew = variants[1], variants[2]
        window = rew.rec._rewind
        starts = sum(_bytes(s.model_state) + _bytes(s.optim["state_dict"]) for s in window.starts)
        held = sum(_bytes(s["batch"]) for s in window.steps) + sum(_bytes(b) for b in window._pool)
        n_batches = len(window.steps) + len(window._pool)
        weights = sum(p.numel() * p.element_size() for p in base.parameters())
        sizes = {}
        for v in (rec, rew):
            v.rec.begin_step(v.step, batches[0])
            loss = loss_fn(v.model, batches[0])
            loss.backward()
            v.rec.end_step(loss)
            sizes[v.name] = v.rec.snapshot().stat().st_size
            v.opt.zero_grad(set_to_none=True)
            v.rec.close()
    med = {k: statistics.median(t) / args.k * 1e3 for k, t in times.items()}
    r_rec = statistics.median(a / b for a, b in zip(times[rec.name], times["plain"]))
    r_rew = statistics.median(a / b for a, b in zip(times[rew.name], times[rec.name]))
    r_rew_plain = statistics.median(a / b for a, b in zip(times[rew.name], times["plain"]))
    mib = 1 / 2**20
    print(f"MLP {args.layers}x{args.width}, {n_params / 1e6:.2f}M params (FP32, Adam), batch {args.batch}, "
          f"K={args.k}, {args.rounds} rounds of K steps per variant, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("| variant | ms / step (median) | ratio |")
    print("|---|---|---|")
    print(f"| plain | {med['plain']:.2f} | 1 |")
    print(f"| recorder | {med[rec.name]:.2f} | {r_rec:.3f} x plain |")
    print(f"| {rew.name} | {med[rew.name]:.2f} | {r_rew:.3f} x recorder ({r_rew_plain:.3f} x plain) |")
    print(f"| (the window's own time: begin_step's copies) | {statistics.median(own) * med['plain']:.3f} | "
          f"{statistics.median(own):.4f} x plain |")
    print()
    print(f"window on the host: 2 starts {starts * mib:.1f} MiB ({starts / weights:.2f} x the weights' "
          f"{weights * mib:.1f} MiB) + {n_batches} batches {held * mib:.2f} MiB")
    print(f"snapshot file: {sizes[rec.name] * mib:.1f} MiB without the window, {sizes[rew.name] * mib:.1f} MiB with it")


if __name__ == "__main__":
    main()

"""Cost of the Recorder's FP8 statistics: a torchao FP8 training step with the recorder against the plain FP8 step.

A small decoder-style stack trained with torchao's FP8 (``convert_to_float8_training``, real ``torch._scaled_mm``
on CPU), AdamW, 1 torch thread, under each recipe asked (``--recipe``: tensorwise and rowwise by default). Variants
per recipe, each with its own copy of the model and optimizer:

- ``plain``: the FP8 step, no recorder;
- ``recorder, fp8_every=None``: the recorder without FP8 statistics (its usual per-step cost);
- ``recorder, fp8_every=1``: FP8 statistics on every step (hooks, one ``cast_counts`` per cast: under rowwise
  scaling each operand is counted for both GEMMs that read it, along each one's axis; under tensorwise once);
- ``recorder, fp8_every=10``: the default, statistics on every 10th step.

Every round times one step of every variant of every recipe, in a freshly shuffled order, and the script prints,
per recipe, the median over the rounds of (variant step / that recipe's plain step of the same round), with the
IQR, the casts counted on a sampled step, and the median sampled step's extra time (``fp8_every=1`` minus
``fp8_every=None``, same round). Trace parts are flushed at close (``flush_every`` above the number of steps), so
no write falls inside the rounds.

    python bench/fp8_recorder_cost.py              # 21 rounds, tensorwise and rowwise
    python bench/fp8_recorder_cost.py --quick      # tiny model, 3 rounds (a smoke run; its numbers mean nothing)

Needs torchao (the ``[fp8]`` extra).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recorders import Recorder  # noqa: E402


class _Block(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class _LM(nn.Module):
    def __init__(self, vocab: int, d: int, hidden: int, layers: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d, hidden) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def _model(size: dict, recipe: str) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = _LM(size["vocab"], size["d"], size["hidden"], size["layers"])
    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))


def _loss(model, batch):
    return F.cross_entropy(model(batch["idx"]).flatten(0, 1), batch["y"].flatten())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, 3 rounds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--recipe", action="append", choices=("tensorwise", "rowwise"),
                    help="torchao recipe (repeatable; default: tensorwise and rowwise)")
    args = ap.parse_args(argv)
    recipes = args.recipe or ["tensorwise", "rowwise"]
    torch.set_num_threads(1)
    size = (dict(vocab=256, d=64, hidden=128, layers=1, batch=2, seq=16) if args.quick else
            dict(vocab=2048, d=256, hidden=768, layers=4, batch=8, seq=64))
    rounds = args.rounds or (3 if args.quick else 21)
    g = torch.Generator().manual_seed(0)
    batches = [{"idx": torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=g),
                "y": torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=g)} for _ in range(8)]
    kinds = {"plain": None, "recorder, fp8_every=None": "none", "recorder, fp8_every=1": 1,
             "recorder, fp8_every=10": 10}
    variants = {(recipe, kind): every for recipe in recipes for kind, every in kinds.items()}
    tmp = tempfile.TemporaryDirectory()
    state = {}
    for (recipe, kind), every in variants.items():
        model = _model(size, recipe)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        rec, run = None, Path(tmp.name) / f"{recipe}_{kind}".replace(" ", "").replace(",", "_")
        if every is not None:
            rec = Recorder(run, model, optimizer=opt, flush_every=10_000, fp8_every=None if every == "none" else every)
        state[(recipe, kind)] = {"model": model, "opt": opt, "rec": rec, "step": 0, "run": run}

    def step(name: tuple[str, str]) -> float:
        s = state[name]
        model, opt, rec, i = s["model"], s["opt"], s["rec"], s["step"]
        batch = batches[i % len(batches)]
        t0 = time.perf_counter()
        if rec is not None:
            rec.begin_step(i, batch)
        loss = _loss(model, batch)
        loss.backward()
        if rec is not None:
            rec.end_step(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        s["step"] = i + 1
        return time.perf_counter() - t0

    for _ in range(3):  # warm-up: allocator, first-call costs
        for name in variants:
            step(name)
    times: dict[tuple[str, str], list[float]] = {n: [] for n in variants}
    order = list(variants)
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            times[name].append(step(name))
    for s in state.values():
        if s["rec"] is not None:
            s["rec"].close()
    import polars as pl

    casts = {r: pl.scan_parquet(state[(r, "recorder, fp8_every=1")]["run"] / "trace" / "fp8-*.parquet")
             .filter(pl.col("step") == 0).select(pl.len()).collect().item() for r in recipes}
    tmp.cleanup()

    params = sum(p.numel() for p in state[(recipes[0], "plain")]["model"].parameters())
    print(f"model: {params / 1e6:.1f}M parameters, {size['layers']} block(s), d {size['d']}, hidden {size['hidden']}, "
          f"batch {size['batch']} x {size['seq']} tokens, torchao FP8 ({', '.join(recipes)}), {rounds} rounds")
    for recipe in recipes:
        plain = times[(recipe, "plain")]
        print(f"\n{recipe}: plain step median {1e3 * statistics.median(plain):.1f} ms; "
              f"{casts[recipe]} casts counted on a sampled step")
        print("| variant | median ratio vs plain (IQR) |")
        print("|---|---:|")
        for kind in kinds:
            r = sorted(t / p for t, p in zip(times[(recipe, kind)], plain))
            q = statistics.quantiles(r, n=4) if len(r) >= 2 else [r[0], r[0], r[0]]
            print(f"| {kind} | {statistics.median(r):.3f} ({q[0]:.2f}-{q[2]:.2f}) |")
        extra = [a - b for a, b in zip(times[(recipe, "recorder, fp8_every=1")],
                                       times[(recipe, "recorder, fp8_every=None")])]
        print(f"a sampled step's FP8 statistics (fp8_every=1 minus fp8_every=None, same round): median "
              f"{1e3 * statistics.median(extra):.2f} ms, {statistics.median(extra) / statistics.median(plain):.1%} of "
              "the plain step")


if __name__ == "__main__":
    main()

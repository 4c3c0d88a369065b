"""False-trigger rate of the Recorder's spike snapshots on healthy runs, and the real spikes they catch.

Four parts, each printed as a table:

1. Real healthy runs of tiny models on CPU, recorded with the Recorder at its default spike settings:
   an MLP regressor (MSE, noisy targets), an MLP classifier (cross entropy that falls near 0) and the
   tiny GPT of ``samples/`` (next-token cross entropy), each with SGD+momentum, Adam and AdamW, FP32
   and BF16 autocast, a linear lr warm-up then cosine decay, several seeds. Counted: the spike
   snapshots each run wrote (``snapshots/*-loss_spike.pt``, ``*-grad_spike.pt``), per 1,000 steps.
2. Synthetic healthy curves fed to the same trigger code (``recorders._spikes.SpikeWatch``): a loss
   decaying as a power law with log-normal noise (sigma 0.05 to 0.5), under lr warm-up and cosine decay,
   and a gradient norm rising during warm-up with heavier noise; 10,000 steps each, many seeds.
3. Real spikes: the MLP whose lr is multiplied by 1000 for one step, and the tiny GPT in BF16 without
   1/sqrt(d) attention scaling at a high lr (attention-logit growth): whether a spike snapshot is written
   and at which step against the first step whose loss is 3x its trailing median.
4. Real healthy runs at a constant lr without warm-up (where Adam's own spikes live): the MLPs with
   Adam, AdamW and SGD, FP32 and BF16, and a Linear-Tanh-Linear regressor on batches of 16 (whose
   fitted batch losses are heavy-tailed: one batch in a thousand is 10-20x the median) with Adam
   (``--constant-only``: this part alone; ``--spikes-only``: part 3 alone).

    python bench/spike_false_triggers.py            # ~45 minutes on one shared core
    python bench/spike_false_triggers.py --quick    # shorter runs, fewer seeds (a smoke run)
    python bench/spike_false_triggers.py --constant-only --steps 3000 --seeds 2

The machine it was measured on was shared with other jobs; the counts do not depend on timing.
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recorders import Recorder, schema  # noqa: E402
from recorders._spikes import SPIKE_Z, SpikeWatch  # noqa: E402
from samples import models as sm  # noqa: E402
from samples._common import gpt_batches  # noqa: E402


def _plain(seed: int) -> nn.Module:
    """Linear, Tanh, Linear, nothing normalised (the model of tests/recorders/spike_models.py)."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def _mlp(seed: int, out: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, out))


def _data(task: str, seed: int):
    if task == "plain":  # batches of 16 from a noisy linear teacher: heavy-tailed batch losses once fitted
        g = torch.Generator().manual_seed(seed + 1)
        w = torch.randn(8, 1, generator=g)
        while True:
            x = torch.randn(16, 8, generator=g)
            yield {"x": x, "y": x @ w + 0.1 * torch.randn(16, 1, generator=g)}
    g = torch.Generator().manual_seed(seed + 100)
    w = torch.randn(16, 4, generator=g)
    while True:
        x = torch.randn(32, 16, generator=g)
        if task == "regress":
            yield {"x": x, "y": torch.tanh(x @ w[:, :1]) + 0.3 * torch.randn(32, 1, generator=g)}
        else:
            yield {"x": x, "y": (x @ w).argmax(1)}


def _loss(task: str):
    if task in ("regress", "plain"):
        return lambda m, b: F.mse_loss(m(b["x"]).float(), b["y"])
    if task == "classify":
        return lambda m, b: F.cross_entropy(m(b["x"]).float(), b["y"])
    return sm.gpt_loss


def _model(task: str, seed: int, scaled: bool = True) -> nn.Module:
    if task == "plain":
        return _plain(seed)
    if task == "gpt":
        torch.manual_seed(seed)
        return sm.build_gpt(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, scale_attn_logits=scaled)
    return _mlp(seed, 1 if task == "regress" else 4)


def _opt(name: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


_LR = {("regress", "sgd"): 0.02, ("classify", "sgd"): 0.05, ("gpt", "sgd"): 0.1}


def train(run_dir: Path, task: str, opt_name: str, dtype, seed: int, steps: int, *, lr_jump: int | None = None,
          lr: float | None = None, scaled: bool = True, warmup: int = 100, jump: float = 1000.0,
          decay: bool = True) -> tuple[list[float], list[Path]]:
    model = _model(task, seed, scaled)
    base_lr = lr if lr is not None else _LR.get((task, opt_name), 3e-3)
    opt = _opt(opt_name, model, base_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)) if decay else 1))
    data = gpt_batches(vocab_size=32, block_size=16, batch_size=16, seed=seed) if task == "gpt" else _data(task, seed)
    loss_fn = _loss(task)
    losses = []
    with Recorder(run_dir, model, amp_dtype=dtype, optimizer=opt, flush_every=500, layer_every=10) as rec:
        for step in range(steps):
            batch = next(data)
            rec.begin_step(step, batch)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
                loss = loss_fn(model, batch)
            loss.backward()
            rec.end_step(loss)
            if lr_jump is not None and step == lr_jump:
                for g in opt.param_groups:
                    g["lr"] *= jump
            opt.step()
            if lr_jump is not None and step == lr_jump:
                for g in opt.param_groups:
                    g["lr"] /= jump
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    snaps = sorted((run_dir / schema.SNAPSHOT_DIR).glob("*.pt")) if (run_dir / schema.SNAPSHOT_DIR).is_dir() else []
    return losses, snaps


ZS = (5.0, 6.0, 7.0, 8.0)


def replay_watch(run_dir: Path, z: float, loss_factor: float = 3.0, grad_factor: float = 10.0) -> int:
    """Fires of the trigger code over a recorded trace's loss and grad_norm columns, uncapped, at `z`."""
    import polars as pl

    steps = pl.read_parquet(run_dir / schema.TRACE_DIR / schema.STEPS_GLOB).sort("step")
    w = SpikeWatch(loss_factor=loss_factor, grad_factor=grad_factor, window=100, z=z)
    return sum(w.check(x, g) is not None for x, g in zip(steps["loss"].to_list(), steps["grad_norm"].to_list()))


def real_runs(steps: int, seeds: int, tmp: Path) -> None:
    print(f"\n1. real healthy runs ({steps} steps each, default settings: loss_spike=3, grad_spike=10, window 100)")
    print(f"{'task':9} {'optimizer':9} {'dtype':6} {'seeds':>5} {'steps':>7} {'loss_spike':>10} {'grad_spike':>10} "
          f"{'per 1k steps':>12}  " + " ".join(f"{'z=' + format(z, 'g'):>6}" for z in ZS))
    total_steps = total = 0
    ztot = dict.fromkeys(ZS, 0)
    for task in ("regress", "classify", "gpt"):
        for opt_name in ("sgd", "adam", "adamw"):
            for dtype in (None, torch.bfloat16):
                counts = {schema.LOSS_SPIKE: 0, schema.GRAD_SPIKE: 0}
                zc = dict.fromkeys(ZS, 0)
                n = steps if task != "gpt" else steps // 2
                for seed in range(seeds):
                    d = tmp / f"{task}-{opt_name}-{dtype}-{seed}"
                    _, snaps = train(d, task, opt_name, dtype, seed, n)
                    for s in snaps:
                        r = schema.SNAPSHOT_RE.match(s.name)[4]
                        if r in counts:
                            counts[r] += 1
                    for z in ZS:
                        zc[z] += replay_watch(d, z)
                k = sum(counts.values())
                total_steps += n * seeds
                total += k
                print(f"{task:9} {opt_name:9} {'bf16' if dtype else 'fp32':6} {seeds:>5} {n * seeds:>7} "
                      f"{counts[schema.LOSS_SPIKE]:>10} {counts[schema.GRAD_SPIKE]:>10} {1000 * k / (n * seeds):>12.3f}  "
                      + " ".join(f"{zc[z]:>6}" for z in ZS))
                for z in ZS:
                    ztot[z] += zc[z]
    print(f"all real runs: {total} spike snapshots in {total_steps} steps = {1000 * total / total_steps:.3f} per 1k steps")
    print("uncapped fires of the same trigger over the recorded traces, per 1k steps: "
          + ", ".join(f"z={z:g}: {1000 * ztot[z] / total_steps:.3f}" for z in ZS) + f" (default z={SPIKE_Z:g})")


def constant_runs(steps: int, seeds: int, tmp: Path, tasks: tuple[str, ...] = ("regress", "classify", "plain")) -> None:
    print(f"\n4. real healthy runs at a constant lr, no warm-up ({steps} steps each, default settings)")
    print(f"{'task':9} {'optimizer':9} {'lr':>6} {'dtype':6} {'steps':>7} {'loss_spike':>10} {'grad_spike':>10} "
          f"{'per 1k steps':>12}  " + " ".join(f"{'z=' + format(z, 'g'):>6}" for z in ZS))
    total_steps = total = 0
    for task, opt_name, lr in (("regress", "adam", 3e-3), ("regress", "adam", 1e-2), ("regress", "sgd", 0.02),
                               ("classify", "adamw", 3e-3), ("classify", "sgd", 0.05), ("plain", "adam", 3e-3),
                               ("plain", "adam", 1e-2)):
        if task not in tasks:
            continue
        for dtype in (None, torch.bfloat16):
            counts = {schema.LOSS_SPIKE: 0, schema.GRAD_SPIKE: 0}
            zc = dict.fromkeys(ZS, 0)
            for seed in range(seeds):
                d = tmp / f"const-{task}-{opt_name}-{lr}-{dtype}-{seed}"
                _, snaps = train(d, task, opt_name, dtype, seed, steps, lr=lr, warmup=1, decay=False)
                for sn in snaps:
                    r = schema.SNAPSHOT_RE.match(sn.name)[4]
                    if r in counts:
                        counts[r] += 1
                for z in ZS:
                    zc[z] += replay_watch(d, z)
            k = sum(counts.values())
            total, total_steps = total + k, total_steps + steps * seeds
            print(f"{task:9} {opt_name:9} {lr:>6g} {'bf16' if dtype else 'fp32':6} {steps * seeds:>7} "
                  f"{counts[schema.LOSS_SPIKE]:>10} {counts[schema.GRAD_SPIKE]:>10} {1000 * k / (steps * seeds):>12.3f}  "
                  + " ".join(f"{zc[z]:>6}" for z in ZS))
    print(f"all constant-lr runs: {total} spike snapshots in {total_steps} steps = {1000 * total / total_steps:.3f} "
          "per 1k steps")


def synthetic(steps: int, seeds: int) -> None:
    print(f"\n2. synthetic healthy curves ({steps} steps each, {seeds} seeds per row)")
    print(f"{'loss noise (log sd)':>19} {'grad noise':>10} {'z':>4} {'loss fires':>10} {'grad fires':>10} "
          f"{'per 1k steps':>12}")
    for sd, z in [(sd, z) for sd in (0.05, 0.1, 0.2, 0.35, 0.5) for z in ZS]:
        lf = gf = 0
        for seed in range(seeds):
            rnd = random.Random(seed)
            w = SpikeWatch(loss_factor=3.0, grad_factor=10.0, window=100, z=z)
            warm = 200
            for t in range(steps):
                lr = min(1.0, (t + 1) / warm) * 0.5 * (1 + math.cos(math.pi * t / steps))
                loss = (4.0 * (1 + t / 50) ** -0.4 + 0.05) * math.exp(rnd.gauss(0, sd))
                # grad norm: grows over the warm-up, then follows the loss, heavier noise (a t-like tail)
                g = (0.3 + 2.0 * min(1.0, t / warm)) * (0.5 + 0.5 * lr) * math.exp(
                    1.5 * sd * rnd.gauss(0, 1) / math.sqrt(max(0.2, rnd.gammavariate(2.0, 0.5))))
                hit = w.check(loss, g)
                if hit and hit["metric"] == "loss":
                    lf += 1
                elif hit:
                    gf += 1
        print(f"{sd:>19} {1.5 * sd:>10.3g} {z:>4g} {lf:>10} {gf:>10} {1000 * (lf + gf) / (steps * seeds):>12.3f}")
    print("(no cap: every fire counted; the noise is log-normal for the loss, heavier-tailed for the gradient norm)")


def real_spikes(tmp: Path, steps: int) -> None:
    print("\n3. real spikes")
    for dtype in (None, torch.bfloat16):
        j = min(400, steps - 50)
        losses, snaps = train(tmp / f"jump-{dtype}", "regress", "adam", dtype, 0, min(600, steps), lr_jump=j)
        names = [s.name for s in snaps] + [f"z={z:g}: {replay_watch(tmp / f'jump-{dtype}', z)} fire(s)" for z in ZS]
        print(f"MLP regressor, Adam, {'bf16' if dtype else 'fp32'}, lr x1000 at step {j} only: loss "
              f"{sorted(losses[j - 100:j])[50]:.3g} (median of the 100 before) -> max {max(losses[j + 1:j + 10]):.3g} "
              f"at the 9 steps after; snapshots: {names or 'none'}")
    for lr in (0.03, 0.1):
        losses, snaps = train(tmp / f"gpt-{lr}", "gpt", "adam", torch.bfloat16, 0, steps, lr=lr, scaled=False,
                              warmup=10, decay=False)
        first = next((t for t in range(100, len(losses))
                      if math.isfinite(losses[t]) and losses[t] > 3 * sorted(losses[t - 100:t])[50]), None)
        print(f"tiny GPT, BF16, no 1/sqrt(d) attention scaling, Adam at a constant lr {lr}: first step whose loss is 3x its trailing "
              f"median: {first}; snapshots: {[s.name for s in snaps] or 'none'}; uncapped fires: "
              + ", ".join(f"z={z:g}: {replay_watch(tmp / f'gpt-{lr}', z)}" for z in ZS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--constant-only", action="store_true", help="part 4 only")
    ap.add_argument("--spikes-only", action="store_true", help="part 3 only")
    ap.add_argument("--tasks", default="regress,classify,plain", help="part 4's tasks, comma-separated")
    ap.add_argument("--steps", type=int, default=4000, help="steps of each real run (the GPT's: half)")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    steps, seeds = (200, 1) if args.quick else (args.steps, args.seeds)
    with tempfile.TemporaryDirectory() as d:
        if args.constant_only:
            constant_runs(steps, seeds, Path(d), tuple(args.tasks.split(",")))
            return
        if args.spikes_only:
            real_spikes(Path(d), 2000)
            return
        real_spikes(Path(d), 300 if args.quick else 2000)
        synthetic(2000 if args.quick else 10000, 2 if args.quick else 20)
        constant_runs(steps, seeds, Path(d))
        real_runs(steps, seeds, Path(d))


if __name__ == "__main__":
    main()

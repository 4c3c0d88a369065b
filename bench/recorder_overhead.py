"""Step-time overhead of the Recorder against a plain step, a naive ``.item()`` loop and detect_anomaly.

A ~17M-parameter decoder-only transformer trains on CPU under BF16 autocast with AdamW. Every
round times one step of each variant, in a freshly shuffled order (seeded), so a noisy, shared
machine slows all variants alike and no variant always follows the same one (a plain rotation
made "plain" always follow detect_anomaly). Each variant's ratio is the median over rounds of
(variant step / plain step of the same round). The recorder's own time inside its steps
(begin_step + end_step) over the plain step of the same round is printed too: it is the
steadier estimate of its overhead.

    python bench/recorder_overhead.py              # 17M params, batch 8x64, 21 rounds (~1-2 min)
    python bench/recorder_overhead.py --batch 16   # longer steps: the recorder's share shrinks
    python bench/recorder_overhead.py --quick      # tiny model, 4 rounds (a smoke run)
    python bench/recorder_overhead.py --model cnn --dtype fp32   # BatchNorm CNN: buffer-copy cost

Variants:
    plain          the step alone
    recorder       Recorder with per-layer statistics every step (layer_every=1, flush_every=50)
    recorder/10    Recorder with per-layer statistics every 10th step
    naive .item()  the common hand-written monitor: ``p.grad.norm().item()`` per parameter
    detect_anomaly ``torch.autograd.detect_anomaly()`` around forward and backward
    buffer copy    the step plus the recorder's pre-step buffer copy alone (``BufferTracker``:
                   the buffers a forward mutates, copied on the device at begin_step so that
                   snapshots hold their pre-forward values); its own time is printed too

``--model cnn`` is a ResNet-style stack of Conv2d + BatchNorm2d (every BatchNorm's running
statistics are written by every forward, so the copy is at its largest relative to the step);
the transformer (``gpt``, default) has no buffers a forward writes, so its copy is empty.
"""
from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from recorders import Recorder
from recorders._buffers import BufferTracker


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class ConvNet(nn.Module):
    """Conv2d + BatchNorm2d + ReLU blocks, global average pool, a linear classifier."""

    def __init__(self, channels: int, blocks: int, classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
        for _ in range(blocks - 1):
            layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def loss_fn(model, batch):
    logits = model(batch["x"])
    return F.cross_entropy(logits.float().flatten(0, -2), batch["y"].flatten())


def _build(kind: str, quick: bool, batch_size: int | None):
    """(model, batches, description, batch size) for ``--model``."""
    g = torch.Generator().manual_seed(1)
    if kind == "cnn":
        channels, blocks, side = (16, 2, 16) if quick else (32, 8, 16)
        batch_size = batch_size or (4 if quick else 16)
        model = ConvNet(channels, blocks)
        batches = [{"x": torch.randn(batch_size, 3, side, side, generator=g),
                    "y": torch.randint(10, (batch_size,), generator=g)} for _ in range(16)]
        return model, batches, f"{batch_size}x3x{side}x{side} images", batch_size
    cfg = dict(vocab=512, d=64, layers=2, heads=4, seq=32) if quick else \
        dict(vocab=8192, d=384, layers=6, heads=6, seq=64)
    batch_size = batch_size or (4 if quick else 8)
    model = GPT(**cfg)
    data = torch.randint(cfg["vocab"], (16, batch_size, cfg["seq"] + 1), generator=g)
    return model, [{"x": d[:, :-1], "y": d[:, 1:]} for d in data], f"{batch_size}x{cfg['seq']} tokens", batch_size


def naive_monitor(model):
    return [p.grad.norm().item() for p in model.parameters() if p.grad is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, 4 rounds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier on a shared box)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--batch", type=int, default=None, help="sequences/images per step (gpt 8, cnn 16; quick: 4)")
    ap.add_argument("--model", choices=["gpt", "cnn"], default="gpt")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (4 if args.quick else 21)
    amp = torch.bfloat16 if args.dtype == "bf16" else None

    torch.manual_seed(0)
    model, batches, shape, batch_size = _build(args.model, args.quick, args.batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n_params = sum(p.numel() for p in model.parameters())
    tracker = BufferTracker(model)  # the "buffer copy" variant's own, outside any Recorder
    copy_time: list[float] = []  # tracker.begin() inside the "buffer copy" steps
    run_dir = tempfile.TemporaryDirectory(prefix="amp-autopsy-bench-")
    rec = Recorder(f"{run_dir.name}/every", model, amp_dtype=amp,
                   optimizer=opt, layer_every=1, flush_every=50)
    rec10 = Recorder(f"{run_dir.name}/every10", model, amp_dtype=amp, optimizer=opt, layer_every=10,
                     flush_every=50)
    step_no = 0
    hot_path: list[float] = []  # begin_step + end_step inside the "recorder" steps

    def step(variant: str) -> float:
        nonlocal step_no
        batch = batches[step_no % len(batches)]
        r = {"recorder": rec, "recorder/10": rec10}.get(variant)
        anomaly = torch.autograd.detect_anomaly() if variant == "detect_anomaly" else contextlib.nullcontext()
        t0 = time.perf_counter()
        if r is not None:
            r.begin_step(step_no, batch)
        if variant == "buffer copy":
            tracker.begin()
            copy_time.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        with anomaly:
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                loss = loss_fn(model, batch)
            loss.backward()
        t2 = time.perf_counter()
        if r is not None:
            r.end_step(loss)
        if variant == "recorder":
            hot_path.append((t1 - t0) + (time.perf_counter() - t2))
        if variant == "naive .item()":
            naive_monitor(model)
        if variant == "buffer copy":
            tracker.end()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        step_no += 1
        return dt

    variants = ["plain", "buffer copy", "recorder", "recorder/10", "naive .item()", "detect_anomaly"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # detect_anomaly warns on every entry
        for v in variants * 2:  # warm-up: allocator, autograd caches, first parquet write
            step(v)
        hot_path.clear()
        copy_time.clear()
        shuffle = random.Random(0).shuffle  # Python's RNG: torch's stream stays the model's
        for _ in range(rounds):
            order = list(variants)
            shuffle(order)
            for v in order:
                times[v].append(step(v))
    rec.close()
    rec10.close()
    run_dir.cleanup()

    plain = times["plain"]
    n_buffers = sum(b.numel() for b in model.buffers())
    watched = sum(tracker.tensors[i].numel() for i in tracker.watch or ())
    print(f"model: {args.model}, {n_params / 1e6:.1f}M params, {n_buffers} buffer elements of which a "
          f"forward writes {watched}, batch {shape}, "
          f"{args.dtype}, {torch.get_num_threads()} thread(s), {rounds} interleaved rounds, torch {torch.__version__}")
    print()
    print("| variant | median step (ms) | median ratio vs plain | ratio IQR |")
    print("|---|---:|---:|---|")
    for v in variants:
        ratios = sorted(t / p for t, p in zip(times[v], plain))
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        print(f"| {v} | {statistics.median(times[v]) * 1e3:.1f} | {statistics.median(ratios):.3f} "
              f"| {q[0]:.3f}-{q[2]:.3f} |")
    # The step-vs-step ratios above carry the machine's noise; the recorder's own time inside its
    # steps (begin_step + end_step, flushes included) is a steadier estimate of its overhead.
    own = sorted(h / p for h, p in zip(hot_path, plain))
    print()
    print(f"recorder's own time (begin_step + end_step, flushes included) / plain step: "
          f"median {statistics.median(own):.3f}, max {own[-1]:.3f} "
          f"(so the recorder's ratio is about {1 + statistics.median(own):.3f})")
    copies = sorted(c / p for c, p in zip(copy_time, plain))
    print(f"pre-step buffer copy alone / plain step: median {statistics.median(copies):.5f}, "
          f"max {copies[-1]:.5f} (median {statistics.median(copy_time) * 1e6:.0f} us)")


if __name__ == "__main__":
    main()

"""Step-time overhead of the Recorder against a plain step, a naive ``.item()`` loop and detect_anomaly.

A ~17M-parameter decoder-only transformer trains on CPU under BF16 autocast with AdamW (or, with
``--size 100m --device cuda --dtype fp16``, a ~100M-parameter one on a GPU under CUDA AMP). Every
round times one step of each variant, in a freshly shuffled order (seeded), so a noisy, shared
machine slows all variants alike and no variant always follows the same one (a plain rotation
made "plain" always follow detect_anomaly). Each variant's ratio is the median over rounds of
(variant step / plain step of the same round). The recorder's own time inside its steps
(begin_step + end_step) over the plain step of the same round is printed too: it is the
steadier estimate of its overhead. On CPU the floor, one read of the gradients, is one
``torch._foreach_norm`` of them, timed in a variant of its own (``plain + one _foreach_norm``):
a plain step that runs it where ``end_step`` would run, right after the backward, so that it is
the first read of the gradients after the backward, as the recorder's is. The recorder's own time
over the floor of the same round is printed at ``layer_every=1`` and, from the ``recorder/10``
variant, for the steps without a layer row (targets: at most 1.5x and 1.1x).

NB: where the floor is read matters on a CPU whose last-level cache nearly holds the gradients
(a Xeon with a large L3: five reads in a row of the same 68 MB took 4.8, 4.7, 4.1, 3.6 and
3.2 ms). ``--floor beside`` times the floor just before and just after ``end_step`` in the
recorder's own step instead (the mean of the two), as this script first did: the recorder's
read then comes second, and the read after it third, faster.

    python bench/recorder_overhead.py              # 17M params, batch 8x64, 21 rounds (~1-2 min)
    python bench/recorder_overhead.py --batch 16   # longer steps: the recorder's share shrinks
    python bench/recorder_overhead.py --quick      # tiny model, 4 rounds (a smoke run)
    python bench/recorder_overhead.py --model cnn --dtype fp32   # BatchNorm CNN: buffer-copy cost
    python bench/recorder_overhead.py --device cuda --dtype fp16 --size 100m   # ~100M params, CUDA AMP
    python bench/recorder_overhead.py --accum 4    # gradient accumulation: 4 micro-batches per step

``--accum N`` makes every variant's step accumulate N micro-batches (each loss divided by N before
its backward, as ``gradient_accumulation_steps=N`` does) and hands the recorders the list of the N
micro-batches, which a snapshot would keep by reference: the ratios are then against an accumulating
plain step.

On CUDA every step is bracketed by ``torch.cuda.synchronize()`` so step times are GPU times, FP16
runs with a GradScaler (as CUDA AMP training does), and a separate, untimed check counts the host
syncs inside ``begin_step`` + ``end_step`` of healthy steps with ``torch.cuda.set_sync_debug_mode``
(the recorder's contract: exactly one, its stacked ``.tolist()``). The "recorder's own time" line is
CPU-only: on CUDA end_step's one sync waits for the queued backward, so its time is not the
recorder's. ``--rows FILE`` appends the results as rows of ``bench/gpu_check.sh``'s table.

Variants:
    plain          the step alone
    recorder       Recorder with per-layer statistics every step (layer_every=1, flush_every=50),
                   the update columns (update_rms, unchanged_frac) included
    recorder/10    Recorder with per-layer statistics every 10th step
    recorder + check_update       ``Recorder(check_update=True)``: after every optimizer step, one
                   fused norm over the weights and one more host sync (its step post hook)
    naive .item()  the common hand-written monitor: ``p.grad.norm().item()`` per parameter
    detect_anomaly ``torch.autograd.detect_anomaly()`` around forward and backward
    buffer copy    the step plus the recorder's pre-step buffer copy alone (``BufferTracker``:
                   the buffers a forward mutates, copied on the device at begin_step so that
                   snapshots hold their pre-forward values); its own time is printed too

``--model cnn`` is a ResNet-style stack of Conv2d + BatchNorm2d (every BatchNorm's running
statistics are written by every forward, so the copy is at its largest relative to the step);
the transformer (``gpt``, default) has no buffers a forward writes, so its copy is empty.

After the rounds, the update columns' own work (``UpdateSample.measure``: a fixed sample of at
most 4096 elements per parameter, compared with the previous recorded row) and check_update's
check (``UpdateCheck.nonfinite``) are timed alone, as medians over the plain step.
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
from recorders._sample import UpdateSample
from recorders._update import UpdateCheck

AMP = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
TARGET_RATIO = 1.02  # the recorder at most 1.02x a plain step (on a GPU)
FLOOR_TARGET = {"layer row": 1.5, "no layer row": 1.1}  # own time / one _foreach_norm of the gradients (CPU)
SIZES = {"small": dict(vocab=8192, d=384, layers=6, heads=6, seq=64),       # ~17M params
         "100m": dict(vocab=8192, d=768, layers=12, heads=12, seq=256)}   # ~98M params


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
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
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


def _build(kind: str, quick: bool, batch_size: int | None, size: str = "small"):
    """(model, batches, description, batch size) for ``--model`` and ``--size``."""
    g = torch.Generator().manual_seed(1)
    if kind == "cnn":
        channels, blocks, side = (16, 2, 16) if quick else (32, 8, 16)
        batch_size = batch_size or (4 if quick else 16)
        model = ConvNet(channels, blocks)
        batches = [{"x": torch.randn(batch_size, 3, side, side, generator=g),
                    "y": torch.randint(10, (batch_size,), generator=g)} for _ in range(16)]
        return model, batches, f"{batch_size}x3x{side}x{side} images", batch_size
    cfg = dict(vocab=512, d=64, layers=2, heads=4, seq=32) if quick else SIZES[size]
    batch_size = batch_size or (4 if quick else 8)
    model = GPT(**cfg)
    data = torch.randint(cfg["vocab"], (16, batch_size, cfg["seq"] + 1), generator=g)
    return model, [{"x": d[:, :-1], "y": d[:, 1:]} for d in data], f"{batch_size}x{cfg['seq']} tokens", batch_size


def naive_monitor(model):
    return [p.grad.norm().item() for p in model.parameters() if p.grad is not None]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()  # deliberate: a step's time must be its GPU time


def count_syncs(model, batches, opt, scaler, amp, steps: int = 8) -> list[int]:
    """Host syncs inside ``begin_step`` + ``end_step`` of each healthy CUDA step (untimed).

    The loop's own work is synchronised first, so ``set_sync_debug_mode("warn")`` sees only the
    recorder's syncs. ``flush_every`` is beyond the run, so no step writes a trace part: a flush
    copies the buffered statistics to the host once per ``flush_every`` steps, by design. Steps
    with non-finite gradients take the recorder's cold path (which may sync) and are left out.
    """
    counts: list[int] = []
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory(prefix="amp-autopsy-sync-") as tmp, \
            Recorder(tmp, model, amp_dtype=amp, optimizer=opt, scaler=scaler, flush_every=10 * steps) as rec:
        for i in range(steps):
            batch = batches[i % len(batches)]

            def watched(loss, i=i, batch=batch):
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        rec.begin_step(i, batch)  # (after the backward, so the loop stays unwatched)
                        rec.end_step(loss)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                if rec.last is not None and rec.last["nonfinite_grads"] == 0:
                    counts.append(sum("synchroniz" in str(w.message) for w in caught))

            train_step(model, batch, opt, scaler, amp, device, after_backward=watched)
    return counts


def train_step(model, batch, opt, scaler, amp, device: torch.device, *, anomaly: bool = False,
               before=None, after_backward=None) -> torch.Tensor:
    """One step, the one loop every variant and the sync count run: forward under autocast,
    (scaled) backward, optimizer step, zero_grad. ``before()`` runs first (begin_step);
    ``after_backward(loss)`` between the backward and the optimizer step (end_step)."""
    if before is not None:
        before()
    parts = batch if isinstance(batch, list) else [batch]  # a list: micro-batches accumulated (--accum)
    loss = None
    with torch.autograd.detect_anomaly() if anomaly else contextlib.nullcontext():
        for part in parts:
            with torch.autocast(device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
                part_loss = loss_fn(model, part)
                part_loss = part_loss / len(parts) if len(parts) > 1 else part_loss
            (scaler.scale(part_loss) if scaler is not None else part_loss).backward()
            loss = part_loss if loss is None else loss + part_loss.detach()
    if after_backward is not None:
        after_backward(loss)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _alone(fn, plain_median: float, repeats: int = 21) -> tuple[float, float]:
    """(median seconds of fn(), that over the plain step): a part of the recorder timed by itself."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return med, med / plain_median


def _quartiles(sorted_values: list[float]) -> str:
    q = statistics.quantiles(sorted_values, n=4) if len(sorted_values) >= 2 else [sorted_values[0]] * 3
    return f"{q[0]:.2f}-{q[2]:.2f}"


def _rows(label: str, ratio: float, plain_ms: float, rounds: int, syncs: list[int] | None) -> list[str]:
    """This run's rows of ``bench/gpu_check.sh``'s table: check | measured | target | result."""
    verdict = "PASS" if ratio <= TARGET_RATIO else "FAIL"
    rows = [f"| recorder step / plain step, {label} | {ratio:.3f}x (plain {plain_ms:.1f} ms, "
            f"median of {rounds} rounds) | <= {TARGET_RATIO}x | {verdict} |"]
    if syncs is not None:
        ok = bool(syncs) and all(n == 1 for n in syncs)
        seen = f"{syncs} over {len(syncs)} healthy steps" if syncs else "no healthy step to count"
        rows.append(f"| host syncs per healthy recorder step, {label} | {seen} | exactly 1 | "
                    f"{'PASS' if ok else 'FAIL'} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, 4 rounds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier on a shared box)")
    ap.add_argument("--dtype", choices=list(AMP), default="bf16", help="autocast dtype (fp16 adds a GradScaler)")
    ap.add_argument("--batch", type=int, default=None, help="sequences/images per step (gpt 8, cnn 16; quick: 4)")
    ap.add_argument("--model", choices=["gpt", "cnn"], default="gpt")
    ap.add_argument("--size", choices=list(SIZES), default="small",
                    help="gpt size: small (~17M params, default) or 100m (~98M params, seq 256)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--accum", type=int, default=1,
                    help="micro-batches per step (gradient accumulation; each loss / N; default 1)")
    ap.add_argument("--sync-steps", type=int, default=8, help="healthy steps whose host syncs are counted (cuda)")
    ap.add_argument("--floor", choices=["apart", "beside"], default="apart",
                    help="CPU: time the floor in a variant of its own, right after its backward (default), "
                    "or just before and after end_step in the recorder's steps")
    ap.add_argument("--rows", metavar="FILE", default=None,
                    help="append the results as Markdown rows (check | measured | target | result) to FILE")
    args = ap.parse_args(argv)
    if args.accum < 1:
        ap.error("--accum must be at least 1")
    if args.model == "cnn" and args.size != "small":
        ap.error("--size applies to --model gpt only")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available here")
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (4 if args.quick else 21)
    amp = AMP[args.dtype]
    device = torch.device(args.device)

    torch.manual_seed(0)
    model, batches, shape, batch_size = _build(args.model, args.quick, args.batch, args.size)
    model.to(device)
    batches = [{k: v.to(device) for k, v in b.items()} for b in batches]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # FP16 trains with a GradScaler, as AMP does; every variant runs the same scaled loop.
    scaler = torch.amp.GradScaler(device.type) if args.dtype == "fp16" else None
    n_params = sum(p.numel() for p in model.parameters())
    tracker = BufferTracker(model)  # the "buffer copy" variant's own, outside any Recorder
    copy_time: list[float] = []  # tracker.begin() inside the "buffer copy" steps
    run_dir = tempfile.TemporaryDirectory(prefix="amp-autopsy-bench-")
    rec = Recorder(f"{run_dir.name}/every", model, amp_dtype=amp, scaler=scaler,
                   optimizer=opt, layer_every=1, flush_every=50)
    rec10 = Recorder(f"{run_dir.name}/every10", model, amp_dtype=amp, scaler=scaler, optimizer=opt, layer_every=10,
                     flush_every=50)
    rec_check = Recorder(f"{run_dir.name}/check", model, amp_dtype=amp, scaler=scaler, optimizer=opt,
                         layer_every=1, flush_every=50, check_update=True)
    rec_check._hook.remove()  # NB: its step post hook runs only in its own variant's steps (below)
    recorders = {"recorder": rec, "recorder/10": rec10, "recorder + check_update": rec_check}
    step_no, round_no = 0, -1
    apart = args.floor == "apart" and device.type == "cpu"
    one_read = "plain + one _foreach_norm"
    floor_of_round: dict[int, float] = {}  # apart: the one_read variant's read, by round
    own_in_round: dict[str, list[tuple[int, float]]] = {"layer row": [], "no layer row": []}
    hot_path: list[float] = []  # begin_step + end_step inside the "recorder" steps
    # (own time, one _foreach_norm of the same gradients) of the recorder (every step a layer row)
    # and of recorder/10's steps without one
    vs_floor: dict[str, list[tuple[float, float]]] = {"layer row": [], "no layer row": []}

    def step(variant: str) -> float:
        nonlocal step_no
        batch = batches[step_no % len(batches)] if args.accum == 1 else \
            [batches[(step_no * args.accum + j) % len(batches)] for j in range(args.accum)]
        r = recorders.get(variant)
        marks: dict[str, float] = {}

        def before():
            tb = time.perf_counter()  # (the own time is the recorder's calls alone, not this harness's)
            if r is not None:
                r.begin_step(step_no, batch)
            if variant == "buffer copy":
                tracker.begin()
                copy_time.append(time.perf_counter() - tb)
            marks["begun"] = time.perf_counter() - tb

        def floor() -> float:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            t = time.perf_counter()
            torch._foreach_norm(grads)  # the floor: one read of the same gradients
            return time.perf_counter() - t

        def after_backward(loss):
            if variant == one_read:  # the floor, where end_step would run (in this step's time)
                floor_of_round[round_no] = floor()
                return
            kind = {"recorder": "layer row", "recorder/10": "no layer row" if step_no % 10 else None}.get(variant)
            timed = kind is not None and device.type == "cpu"
            beside = timed and not apart  # --floor beside: read just before and just after end_step
            t1 = time.perf_counter()
            before = floor() if beside else 0.0
            t2 = time.perf_counter()
            if r is not None:
                r.end_step(loss)
            t3 = time.perf_counter()
            own = marks["begun"] + (t3 - t2)
            if variant == "recorder":
                hot_path.append(own)
            if beside:  # the mean of the two reads
                vs_floor[kind].append((own, (before + floor()) / 2))
                marks["floor"] = (t2 - t1) + (time.perf_counter() - t3)  # taken out of the step's time below
            elif timed:  # against the one_read variant's floor of this round, after the rounds
                own_in_round[kind].append((round_no, own))
            if variant == "naive .item()":
                naive_monitor(model)
            if variant == "buffer copy":
                tracker.end()

        hook = opt.register_step_post_hook(rec_check._after_optimizer_step) if r is rec_check else None
        _sync(device)
        t0 = time.perf_counter()
        train_step(model, batch, opt, scaler, amp, device, anomaly=variant == "detect_anomaly",
                   before=before, after_backward=after_backward)
        _sync(device)
        dt = time.perf_counter() - t0 - marks.get("floor", 0.0)
        if hook is not None:
            hook.remove()
        step_no += 1
        return dt

    variants = ["plain", *([one_read] if apart else []), "buffer copy", "recorder", "recorder + check_update",
                "recorder/10", "naive .item()", "detect_anomaly"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # detect_anomaly warns on every entry
        for v in variants * 2:  # warm-up: allocator, autograd caches, first parquet write
            step(v)
        hot_path.clear()
        copy_time.clear()
        for v in [*vs_floor.values(), *own_in_round.values()]:
            v.clear()
        shuffle = random.Random(0).shuffle  # Python's RNG: torch's stream stays the model's
        for round_no in range(rounds):
            order = list(variants)
            shuffle(order)
            for v in order:
                times[v].append(step(v))
    for kind, owns in own_in_round.items():  # apart: each against the floor of its own round
        vs_floor[kind] += [(own, floor_of_round[n]) for n, own in owns if n in floor_of_round]
    for r in recorders.values():
        r.close()
    run_dir.cleanup()
    syncs = count_syncs(model, batches, opt, scaler, amp, args.sync_steps) if device.type == "cuda" else None

    plain = times["plain"]
    n_buffers = sum(b.numel() for b in model.buffers())
    watched = sum(tracker.tensors[i].numel() for i in tracker.watch or ())
    where = f"{torch.get_num_threads()} thread(s)" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"model: {args.model}, {n_params / 1e6:.1f}M params, {n_buffers} buffer elements of which a "
          f"forward writes {watched}, batch {shape}, "
          f"{args.dtype}, {where}, {rounds} interleaved rounds, torch {torch.__version__}"
          + (f", {args.accum} micro-batches per step" if args.accum > 1 else ""))
    print()
    print("| variant | median step (ms) | median ratio vs plain | ratio IQR |")
    print("|---|---:|---:|---|")
    ratio = {}
    for v in variants:
        ratios = sorted(t / p for t, p in zip(times[v], plain))
        ratio[v] = statistics.median(ratios)
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        print(f"| {v} | {statistics.median(times[v]) * 1e3:.1f} | {ratio[v]:.3f} "
              f"| {q[0]:.3f}-{q[2]:.3f} |")
    print()
    if device.type == "cpu":
        # The step-vs-step ratios above carry the machine's noise; the recorder's own time inside its
        # steps (begin_step + end_step; a flush, every 50 steps, falls outside the rounds) is a steadier estimate.
        own = sorted(h / p for h, p in zip(hot_path, plain))
        print(f"recorder's own time (begin_step + end_step, {'no flush in the rounds' if rounds + 2 < 50 else 'with its flushes'}) / plain step: "
              f"median {statistics.median(own):.3f}, max {own[-1]:.3f} "
              f"(so the recorder's ratio is about {1 + statistics.median(own):.3f})")
        plain_med = statistics.median(plain)
        for kind, pairs in vs_floor.items():
            if not pairs:
                continue
            ratios = sorted(o / f for o, f in pairs)
            own_med, floor_med = statistics.median(o for o, _ in pairs), statistics.median(f for _, f in pairs)
            mean = statistics.fmean(o for o, _ in pairs) / floor_med
            verdict = "PASS" if statistics.median(ratios) <= FLOOR_TARGET[kind] else "FAIL"
            print(f"recorder's own time / one _foreach_norm of the same gradients, steps with {kind}"
                  f"{' (layer_every=1)' if kind == 'layer row' else ' (recorder/10)'}: median {statistics.median(ratios):.2f}"
                  f" (IQR {_quartiles(ratios)}; mean own time / median floor {mean:.2f}); own {own_med * 1e3:.2f} ms, "
                  f"floor {floor_med * 1e3:.2f} ms, {own_med / plain_med:.2%} of the plain step; "
                  f"target <= {FLOOR_TARGET[kind]}: {verdict}")
    else:
        print(f"recorder target: at most {TARGET_RATIO}x a plain step; measured {ratio['recorder']:.3f}x")
        print(f"host syncs inside begin_step + end_step, per healthy step (target: exactly 1): {syncs}")
    copies = sorted(c / p for c, p in zip(copy_time, plain))
    print(f"pre-step buffer copy alone / plain step: median {statistics.median(copies):.5f}, "
          f"max {copies[-1]:.5f} (median {statistics.median(copy_time) * 1e6:.0f} us)")
    params = list(model.parameters())
    sample = UpdateSample(params, device)
    sample.measure()  # the first call only takes the sample; later ones compare
    with torch.no_grad():
        cols, cols_ratio = _alone(lambda: (sample.measure(), _sync(device)), statistics.median(plain))
        check, check_ratio = _alone(lambda: UpdateCheck(params, device, True).nonfinite(), statistics.median(plain))
    print(f"update columns alone (UpdateSample.measure, per recorded row) / plain step: {cols_ratio:.5f} "
          f"(median {cols * 1e6:.0f} us)")
    print(f"check_update's check alone (UpdateCheck.nonfinite, per optimizer step, one host sync) / plain step: "
          f"{check_ratio:.5f} (median {check * 1e6:.0f} us)")
    if args.rows:
        label = f"{args.device} {args.dtype}, {n_params / 1e6:.1f}M params"
        with open(args.rows, "a", encoding="utf-8") as f:
            for row in _rows(label, ratio["recorder"], statistics.median(plain) * 1e3, rounds, syncs):
                f.write(row + "\n")


if __name__ == "__main__":
    main()

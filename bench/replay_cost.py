"""Cost of one replay run per precision, against a plain forward+backward and detect_anomaly.

All variants run on the same snapshot of a ~11M-parameter GPT (samples.models:build_gpt), on
CPU (or ``--device cuda``), interleaved (plain, replay, anomaly, plain, replay, ...) so that load from other processes
hits them alike; the table reports the median plain time and the medians of the per-round
ratios, all measured in this run.

- ``plain``: ``loss_fn(model, batch)`` under autocast and ``(loss * scale).backward()`` on an
  already built model.
- ``replay``: one ``analyzer.replay`` precision run (``_runs.run_once``): rebuilds the model,
  loads the snapshot's weights, restores the RNG, runs forward+backward under the op recorder
  and syncs once. It includes the model rebuild, so it is a conservative number.
- ``anomaly``: the plain step under ``torch.autograd.detect_anomaly()``.

Usage::

    python bench/replay_cost.py            # ~11M params, 7 rounds
    python bench/replay_cost.py --quick    # tiny model, 3 rounds: a smoke run
    python bench/replay_cost.py --device cuda   # the same on a GPU (each variant ends in a sync)

``--rows FILE`` appends one row per precision (replay run / plain against the 1.5x target)
to FILE, for ``bench/gpu_check.sh``'s table.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analyzer.load import load_snapshot  # noqa: E402  (at the top: --help proves every import works)
from analyzer.replay.runs._runs import run_once  # noqa: E402
from analyzer.replay.runs._setup import context  # noqa: E402
from recorders.snapshot import build_snapshot, write_snapshot  # noqa: E402
from samples.models import build_gpt, gpt_loss  # noqa: E402

FULL = dict(vocab_size=1024, block_size=128, n_layer=6, n_head=6, n_embd=384)
QUICK = dict(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64)
TARGET_RATIO = 1.5  # a replay run at most 1.5x a plain forward+backward (on a GPU)


def _plain(model, batch, precision: str, anomaly: bool = False, device: str = "cpu") -> None:
    low = precision != "float32"
    ctx = torch.autograd.detect_anomaly() if anomaly else contextlib.nullcontext()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # detect_anomaly warns that it is slow (on entering it)
        with ctx:
            with torch.autocast(device, dtype=getattr(torch, precision), enabled=low):
                loss = gpt_loss(model, batch)
            loss.float().backward()
    model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()  # the replay run ends in a sync too: both are timed to completion


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 3 rounds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--rows", metavar="FILE", default=None,
                    help="append one Markdown row per precision (check | measured | target | result) to FILE")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available here")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = QUICK if args.quick else FULL
    rounds = args.rounds or (3 if args.quick else 7)
    torch.manual_seed(0)
    model = build_gpt(**cfg)
    n_params = sum(p.numel() for p in model.parameters())
    T = cfg["block_size"]
    batch = {"idx": torch.randint(0, cfg["vocab_size"], (args.batch, T)),
             "targets": torch.randint(0, cfg["vocab_size"], (args.batch, T))}
    with tempfile.TemporaryDirectory() as tmp:
        cuda_rng = torch.cuda.get_rng_state_all() if args.device == "cuda" else None
        snap = build_snapshot(step=0, reason="manual", model=model, batch=batch,
                              rng={"cpu": torch.get_rng_state(), "cuda": cuda_rng},
                              factory="samples.models:build_gpt", factory_kwargs=cfg,
                              loss_fn="samples.models:gpt_loss", amp_dtype=torch.bfloat16,
                              device_type=args.device)
        path = write_snapshot(Path(tmp) / "snap.pt", snap)
        ctx = context(str(path), load_snapshot(path), args.device, None, None, ())  # samples.models: always importable
    model.to(args.device)
    batch = {k: v.to(args.device) for k, v in batch.items()}
    where = f"{torch.get_num_threads()} threads" if args.device == "cpu" else torch.cuda.get_device_name()
    print(f"model: samples.models:build_gpt {cfg}: {n_params / 1e6:.1f}M params, batch {args.batch}x{T}, "
          f"torch {torch.__version__}, {where}, {rounds} interleaved rounds")
    rows = []
    for precision in args.dtypes.split(","):
        times = {"plain": [], "replay": [], "anomaly": []}
        ops = 0
        _plain(model, batch, precision, device=args.device)  # warm-up
        ops = len(run_once(ctx, precision, 1.0).records)
        for _ in range(rounds):
            for name in times:
                t0 = time.perf_counter()
                if name == "replay":
                    run_once(ctx, precision, 1.0)
                    if args.device == "cuda":
                        torch.cuda.synchronize()  # (run_once syncs once already; this makes sure)
                else:
                    _plain(model, batch, precision, anomaly=name == "anomaly", device=args.device)
                times[name].append(time.perf_counter() - t0)
        # Ratios are taken per round (plain, replay and anomaly ran back to back) and then the
        # median is taken: a load change on the shared machine between rounds cancels out.
        med = {"plain": statistics.median(times["plain"])}
        for k in ("replay", "anomaly"):
            med[k] = statistics.median(a / b for a, b in zip(times[k], times["plain"]))
        med["replay/anomaly"] = statistics.median(a / b for a, b in zip(times["replay"], times["anomaly"]))
        rows.append((precision, ops, med))
    print()
    print("| precision | ops recorded | plain fwd+bwd (median) | replay run / plain | detect_anomaly / plain | replay / detect_anomaly |")
    print("|---|---|---|---|---|---|")
    for precision, ops, med in rows:
        print(f"| {precision} | {ops} | {med['plain'] * 1e3:.0f} ms | {med['replay']:.2f}x | "
              f"{med['anomaly']:.2f}x | {med['replay/anomaly']:.2f}x |")
    if args.rows:
        with open(args.rows, "a", encoding="utf-8") as f:
            for precision, _ops, med in rows:
                verdict = "PASS" if med["replay"] <= TARGET_RATIO else "FAIL"
                f.write(f"| replay run / plain fwd+bwd, {args.device} {precision}, {n_params / 1e6:.1f}M params | "
                        f"{med['replay']:.2f}x (plain {med['plain'] * 1e3:.1f} ms, median of {rounds} rounds) | "
                        f"<= {TARGET_RATIO}x | {verdict} |\n")


if __name__ == "__main__":
    main()

"""Cost of the FP8 replay against a plain FP8 forward+backward of the same model (torchao tensorwise or MXFP8).

All variants run on the same snapshot of a GPT (samples.models:build_gpt) whose Linears torchao converts
for tensorwise FP8 training, on CPU, interleaved (plain, fp8 run, diagnosis, plain, ...) so that load
from other processes hits them alike; the table reports the median plain time and the medians of the
per-round ratios, all measured in this run.

- ``plain``: the converted model's ``loss_fn(model, batch)`` under BF16 autocast and ``backward()``
  (``--recipe mxfp8``: torchao's emulated MXFP8 training, BF16 parameters and no autocast, as torchao 0.18 runs
  it on CPU; the snapshot then holds BF16 weights and replays in the ``parameters`` precision mode).
- ``fp8 run``: one FP8 replay run (``fp8.step.run_values(..., fp8=True)``): reloads the weights into the
  converted model, runs forward+backward under the op recorder with every FP8 cast counted
  (``CastWatch``), keeps every gradient and Linear output in FP32 and syncs.
- ``fp8 diagnosis``: what the ``fp8`` probe adds to a replay (``fp8.diagnose.fp8_diagnosis``): the FP32,
  BF16 and FP8 runs with their values kept, and the comparisons.

Usage::

    python bench/fp8_replay_cost.py              # ~11M params, 7 rounds
    python bench/fp8_replay_cost.py --quick      # tiny model, 3 rounds: a smoke run
    python bench/fp8_replay_cost.py --quick --recipe mxfp8
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analyzer.load import load_snapshot  # noqa: E402  (at the top: --help proves every import works)
from analyzer.replay.runs._precision import precision_mode  # noqa: E402
from analyzer.replay.runs._setup import context  # noqa: E402
from analyzer.replay.fp8.diagnose import fp8_diagnosis  # noqa: E402
from analyzer.replay.fp8.step import fp8_context, run_values  # noqa: E402
from recorders.fp8_recipe import describe_fp8  # noqa: E402
from recorders.snapshot import build_snapshot, write_snapshot  # noqa: E402
from samples.models import build_gpt, gpt_loss  # noqa: E402

FULL = dict(vocab_size=1024, block_size=128, n_layer=6, n_head=6, n_embd=384)
QUICK = dict(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64)


def _plain(model, batch, amp: bool = True) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = gpt_loss(model, batch)
    loss.float().backward()
    model.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 3 rounds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--recipe", choices=("tensorwise", "mxfp8"), default="tensorwise")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")  # torchao's import-time notices about kernels it cannot load on CPU
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

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
    mx = args.recipe == "mxfp8"
    if mx:  # torchao's emulated MXFP8 training: BF16 parameters, no autocast; blocks of 32 along every GEMM's K
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization import quantize_

        model = model.to(torch.bfloat16)
        fp8 = build_gpt(**cfg).to(torch.bfloat16)
        fp8.load_state_dict(model.state_dict())
        quantize_(fp8, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL),
                  filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and m.in_features % 32 == 0
                  and m.out_features % 32 == 0)
    else:
        fp8 = convert_to_float8_training(build_gpt(**cfg), config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                         module_filter_fn=lambda m, fqn: m.in_features % 16 == 0
                                         and m.out_features % 16 == 0)
        fp8.load_state_dict(model.state_dict())
    recipe = describe_fp8(fp8)
    with tempfile.TemporaryDirectory() as tmp:
        snap = build_snapshot(step=0, reason="fp8", model=model, batch=batch, rng={"cpu": torch.get_rng_state()},
                              factory="samples.models:build_gpt", factory_kwargs=cfg,
                              loss_fn="samples.models:gpt_loss", amp_dtype=None if mx else torch.bfloat16,
                              device_type="cpu")
        path = write_snapshot(Path(tmp) / "snap.pt", snap)
        loaded = load_snapshot(path)
        ctx = context(str(path), loaded, "cpu", None, None, ())  # samples.models: always importable
        if mx:  # BF16 parameters, no autocast: the replay's parameters mode
            ctx.mode = precision_mode(str(path), loaded, None, loaded.model_state,
                                      {n for n, _ in ctx.build_model().named_parameters()})
    ctx.fp8_recipe = recipe
    fctx = fp8_context(ctx)
    print(f"model: samples.models:build_gpt {cfg}: {n_params / 1e6:.1f}M params, {len(recipe['modules'])} Linears "
          f"in {args.recipe} FP8, batch {args.batch}x{T}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{rounds} interleaved rounds")
    _plain(fp8, batch, not mx)  # warm-up
    first = run_values(fctx, "bfloat16", "fp8", fp8=True)
    fp8_diagnosis(ctx, "bfloat16")
    times: dict[str, list[float]] = {"plain": [], "fp8 run": [], "fp8 diagnosis": []}
    for _ in range(rounds):
        for name in times:
            t0 = time.perf_counter()
            if name == "plain":
                _plain(fp8, batch, not mx)
            elif name == "fp8 run":
                run_values(fctx, "bfloat16", "fp8", fp8=True)
            else:
                fp8_diagnosis(ctx, "bfloat16")
            times[name].append(time.perf_counter() - t0)
    # ratios per round (the variants ran back to back), then their median: load changes between rounds cancel
    plain = statistics.median(times["plain"])
    print()
    print("| variant | ops recorded | casts counted | median | / plain FP8 fwd+bwd (median of per-round ratios) |")
    print("|---|---:|---:|---:|---:|")
    print(f"| plain FP8 fwd+bwd | - | - | {plain * 1e3:.0f} ms | 1.00x |")
    for name in ("fp8 run", "fp8 diagnosis"):
        ratio = statistics.median(a / b for a, b in zip(times[name], times["plain"]))
        ops = len(first.trace.records) if name == "fp8 run" else "3 runs"
        print(f"| {name} | {ops} | {len(first.casts)} | {statistics.median(times[name]) * 1e3:.0f} ms | {ratio:.2f}x |")


if __name__ == "__main__":
    main()

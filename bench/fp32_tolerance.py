"""How far each sample scenario's finite replayed steps are from FP32, in eps (the precision_error tolerance).

Trains every sample scenario (samples/), replays each snapshot, and prints, for each step whose runs are
all finite, the loss and whole-gradient error of the low precision against FP32 in units of the dtype's
eps, beside the tolerance (analyzer/replay/detection/_compare.py). Run: python bench/fp32_tolerance.py [OUT_DIR]
"""
from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # samples/ and tests/ from a checkout

from analyzer.replay import Replay
from analyzer.replay.detection._compare import GRAD_K, LOSS_K, compare
from samples._common import snapshots_of

SCENARIOS = ("healthy", "stalled_layers", "loss_outside_autocast", "fp16_attention_overflow", "bf16_nan",
             "masked_padding", "custom_op_outside_autocast", "log_zero")


def _gpt_run(out: Path, dtype: torch.dtype, steps: int, every: int) -> Path:
    """The samples' tiny GPT (attention scaled), trained healthy, with a manual snapshot every `every` steps."""
    from recorders import Recorder
    from samples import models as sm
    from samples._common import gpt_batches, one_thread

    kwargs = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = sm.build_gpt(**kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = gpt_batches(vocab_size=32, block_size=16, batch_size=16, seed=0)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    with one_thread(), Recorder(out, model, factory=f"{sm.__name__}:build_gpt", factory_kwargs=kwargs,
                                loss_fn=f"{sm.__name__}:gpt_loss", optimizer=opt, amp_dtype=dtype, scaler=scaler) as rec:
        for step in range(steps):
            batch = next(data)
            rec.begin_step(step, batch)
            with torch.autocast("cpu", dtype=dtype):
                loss = sm.gpt_loss(model, batch)
            (scaler.scale(loss) if scaler else loss).backward()
            rec.end_step(loss)
            if step % every == every - 1:
                rec.snapshot()
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
    return out


def main(out: Path) -> None:
    print(f"tolerance: loss {LOSS_K:g} eps, whole gradient {GRAD_K:g} eps")
    runs = [(name, importlib.import_module(f"samples.{name}").run(out / name)) for name in SCENARIOS]
    runs += [(f"tiny_gpt_{d}", _gpt_run(out / f"gpt_{d}", getattr(torch, d), 300, 50)) for d in ("bfloat16", "float16")]
    for name, run_dir in runs:
        for snap in snapshots_of(run_dir):
            r = Replay(snap, device="cpu").run()
            low = r.precision_dtype
            c = compare(r.traces[low], r.traces["float32"]) if low in r.traces else None
            if c is None:
                print(f"{name:28s} {snap.name:40s} {r.verdict:16s} not all finite")
                continue
            print(f"{name:28s} {snap.name:40s} {r.verdict:16s} {low:9s} loss {c.loss_eps:7.3f} eps  "
                  f"grad {c.grad_eps:7.3f} eps  cos {c.grad_cosine:.6f}  worst param {c.worst[0]['param']} "
                  f"{c.worst[0]['rel'] / c.eps:.2f} eps")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))

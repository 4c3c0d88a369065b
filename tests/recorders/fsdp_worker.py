"""The per-rank program of the FSDP2 never-crash test: ``fully_shard`` over gloo on CPU, a Recorder per rank.

``torch.multiprocessing.spawn`` imports this module in each child, so everything is top level.
Each rank trains the same tiny model twice, with and without a Recorder, from the same seed,
and writes what it saw (losses, final weights' digests, the recorder's state and warnings)
to ``OUT/rank{r}.json`` for the test to compare.
"""
from __future__ import annotations

import json
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["WIDTH", "build_model", "mse_loss", "batch_for", "train_rank"]

WIDTH = 8


def build_model(width: int = WIDTH) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def mse_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]).float(), batch["y"])


def batch_for(rank: int, step: int, nan_step: int) -> dict:
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(4, WIDTH, generator=g)
    if rank == 1 and step == nan_step:
        x[0, 0] = float("nan")
    return {"x": x, "y": torch.randn(4, 1, generator=g)}


def _train(rank: int, steps: int, nan_step: int, run_dir: str | None) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from recorders import Recorder

    model = build_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = None
    if run_dir is not None:
        rec = Recorder(run_dir, model, factory=build_model, loss_fn=mse_loss, amp_dtype=torch.bfloat16,
                       optimizer=opt, flush_every=2)
    losses, failures = [], []
    for step in range(steps):
        batch = batch_for(rank, step, nan_step)
        if rec is not None:
            rec.begin_step(step, batch)
        loss = mse_loss(model, batch)
        loss.backward()
        if rec is not None:
            failures.append(rec.end_step(loss))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if rec is not None:
        rec.close()
    local = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    out = {"losses": losses, "weights": {n: t.flatten().tolist() for n, t in local.items()}}
    if rec is not None:
        out.update(stopped=rec.stopped, failures=failures, snapshots=[str(p) for p in rec.snapshots])
    return out


def train_rank(rank: int, world_size: int, init_method: str, run_dir: str, out_dir: str, steps: int,
               nan_step: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            recorded = _train(rank, steps, nan_step, run_dir)
        plain = _train(rank, steps, nan_step, None)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    from recorders.recorder import RecorderWarning

    recorded["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RecorderWarning)]
    recorded["plain"] = plain
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(recorded, f, allow_nan=True)

"""The per-rank program of the distributed test: DDP over gloo on CPU, a Recorder in each rank.

``torch.multiprocessing.spawn`` imports this module in each child, and ``analyzer replay``
rebuilds the model from ``tests.dist_worker:build_model`` / ``tests.dist_worker:mse_loss``,
so everything here is top level.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["WIDTH", "BATCH", "build_model", "mse_loss", "batch_for", "train_rank", "train_unwrapped"]

WIDTH = 8
BATCH = 4


def build_model(width: int = WIDTH) -> nn.Module:
    """Two linear layers, seeded from a private generator: every rank starts from the same weights."""
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def mse_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]), batch["y"])


def batch_for(rank: int, step: int, *, nan_rank: int, nan_step: int) -> dict:
    """Each rank's own batch of each step; one NaN in ``x`` on (nan_rank, nan_step)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, WIDTH, generator=g)
    if (rank, step) == (nan_rank, nan_step):
        x[1, 2] = float("nan")
    return {"x": x, "y": torch.randn(BATCH, 1, generator=g)}


def train_rank(rank: int, world_size: int, port: int, runs: dict[str, bool], steps: int,
               nan_rank: int, nan_step: int, unwrapped: dict[str, bool] | None = None) -> None:
    """Join the gloo group, then train one run per ``runs`` entry (run_dir -> sync_failures),
    then one per ``unwrapped`` entry (``train_unwrapped``), in the same group: one spawn for all.

    FP16 autocast with a GradScaler: the all-reduced NaN gradient only makes the other ranks
    *skip* the step (not a failure by itself), so without ``sync_failures`` only the NaN rank
    snapshots.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from recorders import Recorder

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        for run_dir, sync in runs.items():
            model = build_model()
            ddp = DDP(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
            rec = Recorder(run_dir, model, factory=build_model, factory_kwargs={"width": WIDTH},
                           loss_fn=mse_loss, scaler=scaler, amp_dtype=torch.float16, optimizer=opt,
                           sync_failures=sync)
            with rec:
                for step in range(steps):
                    batch = batch_for(rank, step, nan_rank=nan_rank, nan_step=nan_step)
                    rec.begin_step(step, batch)
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = mse_loss(ddp, batch)
                    scaler.scale(loss).backward()
                    rec.end_step(loss)
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad(set_to_none=True)
            dist.barrier()
        for run_dir, sync in (unwrapped or {}).items():
            train_unwrapped(rank, run_dir, sync)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def train_unwrapped(rank: int, run_dir: str, sync: bool) -> None:
    """A plain FP32 MLP per rank, no DDP and no scaler, an inf in rank 1's target at step 2 of 4.

    Nothing is all-reduced, so only rank 1 fails: what ``sync_failures`` adds is then visible on
    its own, and rank 1's NaN weights (SGD applied the NaN gradient) keep failing after step 2.
    """
    from recorders import Recorder
    from tests.recorders.models import batches, build_mlp, train

    model = build_mlp()
    data = batches(4, seed=rank + 1)
    if rank == 1:
        data[2]["y"][0, 0] = float("inf")  # only rank 1 fails, at step 2
    with Recorder(run_dir, model, factory="tests.recorders.models:build_mlp",
                  loss_fn="tests.recorders.models:mse_loss", sync_failures=sync) as rec:
        train(model, data, rec=rec)

"""Record a real 2-rank FSDP2 run (gloo, CPU) whose gradient reduction overflows FP16 while each rank's is finite.

``MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)`` on both Linear layers and
the root (``tests.dist_worker:build_model``), ``set_gradient_divide_factor(1.0)`` on every sharded
module (a sum, as torchtitan sets it), no GradScaler. The loss is the sum of the outputs, and each
rank's batch is ``X_VALUE`` everywhere: the gradient of ``2.weight`` is about 4.5 * X_VALUE = 4.0e4 on
each rank (finite in FP16), so their sum in the reduce-scatter, 8.1e4, is beyond FP16's 65504. Step 0
fails (``nonfinite_grads`` on rank 0, which holds ``2.weight``'s one row); with ``sync_failures=True``
every rank snapshots it into one DCP directory.

Example (~10 s on two cores):
    >>> run = record_reduce_overflow(tmp_path)      # doctest: +SKIP
    >>> sorted(p.name for p in (run / "snapshots").iterdir())  # doctest: +SKIP
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tests._spawn import spawn_ranks

__all__ = ["X_VALUE", "WORLD", "sum_loss", "build_halved", "Halved", "sum_loss_killing_rank_1",
           "sum_loss_killing_rank_1_while_rank_0_computes",
           "record_reduce_overflow", "train_rank"]

WORLD = 2
X_VALUE = 9000.0
STEPS = 1


def sum_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The sum of the outputs, in FP32."""
    return model(batch["x"]).float().sum()


class Halved(nn.Module):
    """``build_model``'s MLP whose output is multiplied by a non-persistent buffer (no checkpoint holds it)."""

    def __init__(self):
        super().__init__()
        from tests.dist_worker import build_model

        self.net = build_model()
        self.register_buffer("gain", torch.full((1,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.gain


def build_halved() -> nn.Module:
    return Halved()


def train_rank(rank: int, world_size: int, init_method: str, run_dir: str, halved: bool = False) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from recorders import Recorder
    from tests.dist_worker import BATCH, WIDTH, build_model, init_group

    init_group(rank, world_size, init_method, timeout_s=60.0)
    model = build_halved() if halved else build_model()
    net = model.net if halved else model
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
    for m in (net[0], net[2], model):
        fully_shard(m, mp_policy=policy)
    for m in (net[0], net[2], model):
        m.set_gradient_divide_factor(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    rec = Recorder(run_dir, model, factory=build_halved if halved else build_model,
                   factory_kwargs={} if halved else {"width": WIDTH}, loss_fn=sum_loss,
                   amp_dtype=torch.float16, optimizer=opt, flush_every=1, sync_failures=True)
    with rec:
        for step in range(STEPS):
            # the halved model's output gain of 0.5 is made up by a batch twice as large: the same gradients
            batch = {"x": torch.full((BATCH, WIDTH), X_VALUE * (2 if halved else 1))}
            rec.begin_step(step, batch)
            loss = sum_loss(model, batch)
            loss.backward()
            rec.end_step(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
    torch.distributed.destroy_process_group()


def record_reduce_overflow(root: str | Path, timeout_s: float = 120.0, world: int = WORLD, halved: bool = False
                           ) -> Path:
    """Train the run under `root`/run on `world` spawned processes; return its run directory.

    `halved`: the model is ``build_halved`` (a non-persistent buffer scales the output by 0.5).
    """
    root = Path(root)
    run_dir = root / "run"
    root.mkdir(parents=True, exist_ok=True)
    codes = spawn_ranks(train_rank, (world, f"file://{root}/rendezvous", str(run_dir), halved), world, timeout_s)
    if any(codes):
        raise RuntimeError(f"FSDP2 ranks exited with codes {codes}")
    return run_dir


def sum_loss_killing_rank_1_while_rank_0_computes(model: nn.Module, batch: dict) -> torch.Tensor:
    """``sum_loss_killing_rank_1`` whose rank 0 is still computing (20 s of Python) when rank 1 dies: torchrun then
    stops rank 0 with SIGTERM before it reaches a collective that would fail."""
    import os
    import time

    if os.environ.get("RANK") == "0":
        time.sleep(20)
    return sum_loss_killing_rank_1(model, batch)


def sum_loss_killing_rank_1(model: nn.Module, batch: dict) -> torch.Tensor:
    """``sum_loss`` whose rank 1 SIGKILLs itself mid-forward (after the root's all-gather): a rank that dies."""
    import os
    import signal

    out = model[0](batch["x"])
    if os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return model[2](model[1](out)).float().sum()

"""Record real 2-rank DDP runs (gloo, CPU) in one spawn: each with another communication hook.

- ``compress``: ``fp16_compress_hook``, the Recorder given the module inside DDP (as docs/recorder.md
  advises: names without ``module.``; DDP is found in the first forward), FP32 training with no
  GradScaler. The loss is the sum of the outputs of ``tests.dist_worker:build_model``; rank r's batch
  is ``X_VALUES[r]`` everywhere, so the gradient of ``2.weight`` is about 4.5 * X on each rank: 4.5e3 on
  rank 0 and 8.1e4 on rank 1, finite in FP32 but beyond FP16's 65504. The hook casts each rank's bucket
  to FP16 (rank 1's becomes inf), divides it by 2 and all-reduces: every rank's reduced gradient is
  inf at step 0 (``nonfinite_grads``; with ``sync_failures=True`` both ranks snapshot it). In FP32 (no
  hook) the mean is about 4.3e4: finite.
- ``wrapper``: ``allreduce_hook`` (torch refuses ``bf16_compress_hook`` on CPU), the Recorder given the DDP wrapper.
- ``custom``: a hook of the user's own (``halve_then_allreduce``), the Recorder given the module: ``"unknown"``.
- ``plain``: no hook, the Recorder given the wrapper.
- ``builtin``: DDP's C++ ``BuiltinCommHookType.FP16_COMPRESS`` (``_register_builtin_comm_hook``), given the wrapper.
- ``accum``: ``compress`` with gradient accumulation as users write it: the step's two micro-batches (rank r's
  ``x`` is ``X_VALUES[r]`` in both) given to ``begin_step`` as a list, each loss divided by 2, the first
  backward under ``ddp.no_sync()``: DDP reduces once, after the last, the accumulated 8.1e4 on rank 1 (inf in
  FP16). Each micro-batch's own gradient (4.05e4) fits FP16, so a reduction after every micro-batch stays finite.

Example (~10 s on two cores):
    >>> runs = record_ddp_runs(tmp_path)                   # doctest: +SKIP
    >>> sorted(p.name for p in (runs["compress"] / "snapshots").iterdir())  # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

__all__ = ["WORLD", "X_VALUES", "RUNS", "sum_loss", "halve_then_allreduce", "record_ddp_runs", "train_rank"]

WORLD = 2
X_VALUES = (1000.0, 18000.0)
RUNS = ("compress", "wrapper", "custom", "plain", "builtin", "accum")


def sum_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The sum of the outputs, in FP32."""
    return model(batch["x"]).float().sum()


def halve_then_allreduce(state, bucket):
    """A user's own hook (numerics no recorder can name): the bucket halved, then all-reduced."""
    t = bucket.buffer().div_(2)
    return dist.all_reduce(t, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _train(rank: int, run_dir: str, name: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from recorders import Recorder
    from tests.dist_worker import BATCH, WIDTH, build_model

    model = build_model()
    ddp = DDP(model)
    hook = {"compress": default_hooks.fp16_compress_hook, "wrapper": default_hooks.allreduce_hook,
            "custom": halve_then_allreduce, "accum": default_hooks.fp16_compress_hook}.get(name)
    given = model if name in ("compress", "custom", "accum") else ddp
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    rec = Recorder(run_dir, given, factory=build_model, factory_kwargs={"width": WIDTH}, loss_fn=sum_loss,
                   optimizer=opt, flush_every=1, sync_failures=True)
    if hook is not None:  # NB: after the Recorder, as loops often do: the snapshots read the hook when taken
        ddp.register_comm_hook(None, hook)
    if name == "builtin":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    if name == "accum":
        with rec:
            _accumulate(rec, ddp, rank)
        return
    with rec:
        batch = {"x": torch.full((BATCH, WIDTH), X_VALUES[rank] if name == "compress" else 1.0)}
        rec.begin_step(0, batch)
        loss = sum_loss(ddp, batch)
        loss.backward()
        rec.end_step(loss)
        if name != "compress":
            rec.snapshot()  # a manual snapshot: what the recorder read of the hook
        opt.step()


def _accumulate(rec, ddp, rank: int) -> None:
    """One step of two micro-batches, as a DDP loop accumulates: no_sync() until the last backward."""
    from tests.dist_worker import BATCH, WIDTH

    mbs = [{"x": torch.full((BATCH, WIDTH), X_VALUES[rank])} for _ in range(2)]
    rec.begin_step(0, mbs)
    step_loss = 0.0
    for k, mb in enumerate(mbs):
        sync = contextlib.nullcontext() if k == len(mbs) - 1 else ddp.no_sync()
        with sync:
            loss = sum_loss(ddp, mb) / len(mbs)
            loss.backward()
        step_loss = step_loss + loss.detach()
    rec.end_step(step_loss)


def train_rank(rank: int, world_size: int, init_method: str, root: str) -> None:
    from tests.dist_worker import init_group

    init_group(rank, world_size, init_method, timeout_s=60.0)
    try:
        for name in RUNS:
            _train(rank, str(Path(root) / name), name)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def record_ddp_runs(root: Path) -> dict[str, Path]:
    """Train every run of ``RUNS`` under ``root`` on two spawned ranks; {name: run directory}."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # NB: spawn, not fork: forked children hung in gloo after other tests had run in the parent
    mp.spawn(train_rank, args=(WORLD, f"tcp://127.0.0.1:{port}", str(root)), nprocs=WORLD, join=True)
    return {name: root / name for name in RUNS}

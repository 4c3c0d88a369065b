"""Record real 2-rank FSDP2 runs (gloo, CPU) whose NaN/Inf is born in an ordinary op of rank 1's step.

One spawn per run kind (``KINDS``), each a run directory under the root, ``sync_failures=True`` (one DCP
directory per failing step), the model ``tests.dist_worker:build_model`` (Linear(8, 8), ReLU, Linear(8, 1))
under ``fully_shard`` at both Linears and the root:

- ``log0``: ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``, the loss
  ``log_loss``: the log of the outputs' magnitude times the batch's mask ``m``; rank 1's mask holds an
  exact zero, so ``aten.log`` in ``<loss_fn>`` reads 0 and makes -inf in FP32 too (``numerical_bug``).
- ``overflow``: ``param_dtype=torch.float16, reduce_dtype=torch.float32``, the loss the outputs' sum;
  rank 1's batch is ``BIG`` everywhere, so the first Linear's addmm leaves FP16's range from finite
  inputs (about 2e5 in FP32); rank 0's batch is 1 everywhere and stays finite.
- ``accum``: ``overflow``'s step as two micro-batches (``Recorder(micro_batches=2)``, each loss / 2 before its
  backward, ``set_requires_gradient_sync(False)`` on the first, as FSDP2 users accumulate); only rank 1's
  second micro-batch is ``BIG``.
- ``accum_plain``: ``accum`` accumulated plainly: every micro-batch's backward reduce-scatters.

Example (~10 s per kind on two cores):
    >>> run = record_op_run(tmp_path, "log0")        # doctest: +SKIP
    >>> sorted(p.name for p in (run / "snapshots").glob("*.pt"))  # doctest: +SKIP
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tests._spawn import spawn_ranks

__all__ = ["KINDS", "WORLD", "BIG", "FAULT_RANK", "log_loss", "sum_loss", "sum_loss_rank_1_runs_more_ops",
           "record_op_run", "train_rank"]

KINDS = ("log0", "overflow", "accum", "accum_plain")
WORLD, FAULT_RANK = 2, 1
BIG = 6.0e4  # finite in FP16 (max 65504); through the first Linear (weights ~0.3 * randn) about 2e5


def log_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The mean log of the outputs' magnitude times the mask ``m`` (an exact 0 in ``m`` is log(0))."""
    return torch.log(model(batch["x"]).float().abs() * batch["m"]).mean()


def sum_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The sum of the outputs, in FP32."""
    return model(batch["x"]).float().sum()


def _batch(kind: str, rank: int, micro: int = 0) -> dict:
    from tests.dist_worker import BATCH, WIDTH

    x = torch.ones(BATCH, WIDTH)
    if kind == "log0":
        m = torch.ones(BATCH, 1)
        if rank == FAULT_RANK:
            m[1, 0] = 0.0
        return {"x": x, "m": m}
    big = rank == FAULT_RANK and (kind == "overflow" or micro == 1)
    return {"x": torch.full((BATCH, WIDTH), BIG) if big else x}


def train_rank(rank: int, world_size: int, init_method: str, run_dir: str, kind: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from recorders import Recorder
    from tests.dist_worker import WIDTH, build_model, init_group

    init_group(rank, world_size, init_method, timeout_s=60.0)
    model = build_model()
    low = torch.bfloat16 if kind == "log0" else torch.float16
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    for m in (model[0], model[2], model):
        fully_shard(m, mp_policy=policy)
    loss_fn = log_loss if kind == "log0" else sum_loss
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    micro = 2 if kind.startswith("accum") else None
    rec = Recorder(run_dir, model, factory=build_model, factory_kwargs={"width": WIDTH}, loss_fn=loss_fn,
                   amp_dtype=low, optimizer=opt, flush_every=1, sync_failures=True, micro_batches=micro)
    with rec:
        if micro is None:
            batch = _batch(kind, rank)
            rec.begin_step(0, batch)
            loss = loss_fn(model, batch)
            loss.backward()
        else:
            parts = [_batch(kind, rank, i) for i in range(micro)]
            rec.begin_step(0, parts)
            total = 0.0
            for i, part in enumerate(parts):
                if kind == "accum":
                    model.set_requires_gradient_sync(i == micro - 1)  # reduce once, after the last micro-batch
                part_loss = loss_fn(model, part) / micro
                part_loss.backward()
                total = total + part_loss.detach()
            loss = total
        rec.end_step(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.distributed.destroy_process_group()


def record_op_run(root: str | Path, kind: str, timeout_s: float = 120.0) -> Path:
    """Train `kind` (one of ``KINDS``) under `root`/`kind` on two spawned processes; return its run directory."""
    root = Path(root)
    run_dir = root / kind
    root.mkdir(parents=True, exist_ok=True)
    codes = spawn_ranks(train_rank, (WORLD, f"file://{root}/rendezvous-{kind}", str(run_dir), kind), WORLD, timeout_s)
    if any(codes):
        raise RuntimeError(f"FSDP2 ranks exited with codes {codes}")
    return run_dir


def sum_loss_rank_1_runs_more_ops(model: nn.Module, batch: dict) -> torch.Tensor:
    """``sum_loss`` with one more op on rank 1 (a clone of the outputs): ranks whose steps run different ops."""
    import os

    out = model(batch["x"]).float()
    if os.environ.get("RANK") == "1":
        out = out.clone()
    return out.sum()

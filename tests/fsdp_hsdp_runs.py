"""Record real 4-rank HSDP runs (gloo, CPU): ``fully_shard`` on a 2x2 ``("replicate", "shard")`` device mesh.

One spawn trains every kind (``KINDS``), each a run directory under the root, ``sync_failures=True`` (one DCP
directory per failing step), the model ``tests.dist_worker:build_model`` (Linear(8, 8), ReLU, Linear(8, 1))
under ``fully_shard(mesh=...)`` at both Linears and the root. Ranks 0 and 1 form one shard group, 2 and 3
the other; each gradient is reduce-scattered in its shard group, then all-reduced across the replicas
(0 with 2, 1 with 3):

- ``overflow``: ``MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)``, the loss the
  outputs' sum (``tests.fsdp_op_runs:sum_loss``); rank 1's batch is ``fsdp_op_runs.BIG`` everywhere, so the
  first Linear's FP16 addmm leaves FP16's range from finite inputs (an ordinary op, rank 1 only).
- ``reduce``: ``param_dtype=reduce_dtype=torch.float16``, ``set_gradient_divide_factor(1.0)`` (a sum), every
  rank's batch ``X_VALUE``: ``2.weight``'s gradient is about 4.5 * X_VALUE = 2.7e4 on each rank, 5.4e4 summed
  in a shard group's reduce-scatter (finite in FP16), and 1.1e5 in the all-reduce across the replicas.

Example (~20 s on two cores):
    >>> runs = record_hsdp_runs(tmp_path)            # doctest: +SKIP
    >>> sorted(p.name for p in (runs["overflow"] / "snapshots").glob("*.pt"))  # doctest: +SKIP
"""
from __future__ import annotations

from pathlib import Path

import torch

from tests._spawn import spawn_ranks

__all__ = ["KINDS", "WORLD", "MESH", "MESH_NAMES", "X_VALUE", "record_hsdp_runs", "train_rank"]

KINDS = ("overflow", "reduce")
MESH, MESH_NAMES = (2, 2), ("replicate", "shard")
WORLD = MESH[0] * MESH[1]
X_VALUE = 6000.0


def _train(rank: int, mesh, run_dir: str, kind: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from recorders import Recorder
    from tests.dist_worker import BATCH, WIDTH, build_model
    from tests.fsdp_op_runs import BIG, FAULT_RANK, sum_loss

    model = build_model()
    reduce = kind == "reduce"
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16 if reduce else torch.float32)
    for m in (model[0], model[2], model):
        fully_shard(m, mesh=mesh, mp_policy=policy)
        if reduce:
            m.set_gradient_divide_factor(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    rec = Recorder(run_dir, model, factory=build_model, factory_kwargs={"width": WIDTH}, loss_fn=sum_loss,
                   amp_dtype=torch.float16, optimizer=opt, flush_every=1, sync_failures=True)
    value = X_VALUE if reduce else (BIG if rank == FAULT_RANK else 1.0)
    with rec:
        batch = {"x": torch.full((BATCH, WIDTH), value)}
        rec.begin_step(0, batch)
        loss = sum_loss(model, batch)
        loss.backward()
        rec.end_step(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)


def train_rank(rank: int, world_size: int, init_method: str, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.dist_worker import init_group

    init_group(rank, world_size, init_method, timeout_s=60.0)
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=MESH_NAMES)
    for kind in KINDS:
        _train(rank, mesh, str(Path(root) / kind), kind)
    torch.distributed.destroy_process_group()


def record_hsdp_runs(root: str | Path, timeout_s: float = 180.0) -> dict[str, Path]:
    """Train every kind under `root`/KIND on four spawned processes; return each kind's run directory."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    codes = spawn_ranks(train_rank, (WORLD, f"file://{root}/rendezvous", str(root)), WORLD, timeout_s)
    if any(codes):
        raise RuntimeError(f"HSDP ranks exited with codes {codes}")
    return {kind: root / kind for kind in KINDS}

"""The per-rank programs of the distributed tests: DDP and FSDP2 over gloo on CPU, a Recorder per rank.

``torch.multiprocessing.spawn`` imports this module in each child, and ``analyzer replay``
rebuilds the model from ``tests.dist_worker:build_model`` / ``tests.dist_worker:mse_loss``
(``fsdp_loss`` for the FSDP2 runs), so everything here is top level. ``init_group`` is the one
process-group setup; the FSDP2 runs are ``train_fsdp_rank`` (driven by ``tests/fsdp_runs.py``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["WIDTH", "BATCH", "build_model", "mse_loss", "fsdp_loss", "batch_for", "init_group", "train_rank",
           "train_unwrapped", "train_bf16_ddp", "BF16_NAN_STEP", "train_fsdp_rank"]

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


def init_group(rank: int, world_size: int, init_method: str, timeout_s: float = 60.0) -> None:
    """Join the gloo group: one thread per process (two ranks share a small machine), and a
    collective timeout, so a rank whose peer died errors out instead of waiting forever."""
    from datetime import timedelta

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def train_rank(rank: int, world_size: int, port: int, runs: dict[str, bool], steps: int,
               nan_rank: int, nan_step: int, unwrapped: dict[str, bool] | None = None,
               bf16_run: str | None = None) -> None:
    """Join the gloo group, then train one run per ``runs`` entry (run_dir -> sync_failures),
    then one per ``unwrapped`` entry (``train_unwrapped``), then ``bf16_run`` (``train_bf16_ddp``),
    in the same group: one spawn for all.

    FP16 autocast with a GradScaler: the all-reduced NaN gradient only makes the other ranks
    *skip* the step (not a failure by itself), so without ``sync_failures`` only the NaN rank
    snapshots.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from recorders import Recorder

    init_group(rank, world_size, f"tcp://127.0.0.1:{port}")
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
        if bf16_run is not None:
            train_bf16_ddp(rank, bf16_run, BF16_NAN_STEP)
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


BF16_NAN_STEP = 6


def train_bf16_ddp(rank: int, run_dir: str, nan_step: int) -> None:
    """DDP under BF16 autocast with no GradScaler: one NaN in rank 1's batch at `nan_step`. The
    all-reduce averages rank 1's NaN gradients into rank 0's, and SGD applies them, so every weight
    is NaN afterwards and rank 0's own loss is NaN from the next step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from recorders import Recorder
    from tests.analyzer.report import report_models as rm

    torch.manual_seed(0)
    model = DDP(rm.build_small_mlp(16))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    with Recorder(run_dir, model, factory="tests.analyzer.report.report_models:build_small_mlp",
                  factory_kwargs={"width": 16}, loss_fn=rm.mlp_loss, amp_dtype=torch.bfloat16,
                  optimizer=opt, flush_every=5) as rec:
        for step in range(nan_step + 4):
            x = torch.randn(32, 16, generator=g)
            if rank == 1 and step == nan_step:
                x[3, 5] = float("nan")  # one bad sample in rank 1's local batch
            batch = {"x": x, "y": torch.randint(0, 4, (32,), generator=g)}
            rec.begin_step(step, batch)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = rm.mlp_loss(model, batch)
            loss.backward()
            rec.end_step(loss)
            opt.step()


# ------------------------------------------------------------------------------------------ FSDP2
def fsdp_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """MSE in FP32: FSDP2's BF16 ``param_dtype`` makes the model's output BF16."""
    return F.mse_loss(model(batch["x"]).float(), batch["y"])


def _fsdp_model():
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model[0], mp_policy=policy)
    fully_shard(model[2], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _inject(model: nn.Module, fault: dict) -> None:
    """Write inf into this rank's shard of one parameter, in place: the corruption a bad
    optimizer step (or a bad write) on one rank leaves in the weights it owns."""
    param = model.get_parameter(fault["param"])
    with torch.no_grad():
        param.to_local()[tuple(fault["local_index"])] = float("inf")


def _train_fsdp(rank: int, steps: int, fault: dict, run_dir: str | None, sync: bool, kill_step: int | None,
                reference: bool, batch_nan: bool = False, max_snapshots: int = 3) -> dict:
    """One FSDP2 run; returns what the test compares (losses, local weights, the recorder's view).

    `batch_nan`: the fault is a NaN in the fault rank's batch instead of an inf in its shard.
    """
    import os
    import signal

    from recorders import Recorder

    model = _fsdp_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = None
    if run_dir is not None:
        rec = Recorder(run_dir, model, factory=build_model, factory_kwargs={"width": WIDTH}, loss_fn=fsdp_loss,
                       amp_dtype=torch.bfloat16, optimizer=opt, flush_every=1, sync_failures=sync,
                       max_snapshots=max_snapshots)
    out = {"losses": [], "failures": [], "ref_grad_norms": [], "ref_param_norms": []}
    try:
        for step in range(steps):
            batch = batch_for(rank, step, nan_rank=fault["rank"] if batch_nan else -1, nan_step=fault["step"])
            if step == fault["step"] and rank == fault["rank"] and not batch_nan:
                _inject(model, fault)
            if rec is not None:
                rec.begin_step(step, batch)
            if step == kill_step and rank == fault["rank"]:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-run, mid-step: no flush, no close
            loss = fsdp_loss(model, batch)
            loss.backward()
            if rec is not None:
                out["failures"].append(rec.end_step(loss))
            if reference:  # the unsharded truth, gathered (a collective the test adds, not the recorder)
                out["ref_grad_norms"].append([p.grad.full_tensor().norm().item() for p in model.parameters()])
                out["ref_param_norms"].append([p.full_tensor().norm().item() for p in model.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
            out["losses"].append(loss.item())
    except RuntimeError as e:  # the killed peer: gloo raises at the next collective
        out["peer_error"] = f"{type(e).__name__}: {e}"[:300]
    if rec is not None:
        rec.close()
        out.update(stopped=rec.stopped, snapshots=[str(p) for p in rec.snapshots], write_errors=rec.write_errors)
    out["weights"] = {n: p.to_local().detach().flatten().tolist() for n, p in model.named_parameters()}
    return out


def train_fsdp_rank(rank: int, world_size: int, init_method: str, runs: dict[str, dict], steps: int,
                    fault: dict, out_dir: str) -> None:
    """Train each of `runs` (name -> {"run_dir", "sync", "kill_step", "reference"}) in one gloo group,
    in order, and write ``OUT/rank{r}.json``. A run with a ``kill_step`` must come last: its
    fault rank SIGKILLs itself there, and the other ranks stop at their next collective."""
    import json
    import os
    import warnings

    from recorders.recorder import RecorderWarning

    init_group(rank, world_size, init_method, timeout_s=30.0)
    results: dict[str, dict] = {}
    killed = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, spec in runs.items():
            results[name] = _train_fsdp(rank, steps, fault, spec.get("run_dir"), bool(spec.get("sync")),
                                        spec.get("kill_step"), bool(spec.get("reference")),
                                        bool(spec.get("batch_nan")), spec.get("max_snapshots", {}).get(str(rank), 3))
            results["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RecorderWarning)]
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:  # written after each run:
                json.dump(results, f, allow_nan=True)  # the killed run's rank writes nothing after it
            if spec.get("kill_step") is not None:
                killed = True
                break
            dist.barrier()
    if killed:
        os._exit(0)  # the group lost a member: destroying it could wait on the dead peer
    dist.destroy_process_group()

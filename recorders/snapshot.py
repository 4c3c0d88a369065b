"""Failure-step snapshots: a plain dict of tensors and primitives, written atomically.

A snapshot holds what ``analyzer replay`` needs to re-run one step offline: the weights and
buffers before the optimizer step, the batch, the RNG state captured at ``begin_step``, the
loss scale, the autocast dtype and the references that rebuild the model and the loss.
Its keys are ``schema.SNAPSHOT_KEYS``; ``torch.load(weights_only=True)`` reads it.
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import torch

from . import schema
from .compiled import clean_name
from ._io import atomic_write, claim_write
from ._meta import current_cwd
from ._sdpa import sdpa_state

__all__ = ["to_cpu_tree", "build_snapshot", "write_snapshot", "claim_snapshot"]

_PRIMITIVES = (int, float, str, bool, bytes, type(None), torch.dtype, torch.device, torch.Size)


def to_cpu_tree(obj: Any, path: str = "batch") -> Any:
    """Copy a nested dict/list/tuple of tensors to detached CPU tensors; primitives pass through.

    numpy arrays become tensors (weights_only loading refuses numpy). Anything else raises
    TypeError naming where it sits, e.g. ``batch['meta'][2]``.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu_tree(v, f"{path}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [to_cpu_tree(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, _PRIMITIVES):
        return obj
    if type(obj).__module__ == "numpy" and hasattr(obj, "dtype"):
        return torch.as_tensor(obj).clone()
    raise TypeError(
        f"{path} is a {type(obj).__module__}.{type(obj).__name__}; snapshots hold tensors, "
        "dicts, lists, tuples and primitives only"
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (no collective); a wrapper subclass holding its values as a plain ``_data`` of its
    own dtype (torchao's MXFP8 training weights) as that plain tensor, so the snapshot loads with
    ``weights_only=True``; any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    t = to_local() if callable(to_local) else t
    data = getattr(t, "_data", None)
    if (type(t) not in (torch.Tensor, torch.nn.Parameter) and type(data) is torch.Tensor
            and data.dtype == t.dtype and data.shape == t.shape):
        return data
    return t


def build_snapshot(
    *,
    step: int,
    reason: str,
    model: torch.nn.Module,
    batch: Any,
    rng: dict[str, Any],
    factory: str,
    factory_kwargs: dict,
    loss_fn: str,
    amp_dtype: torch.dtype | None,
    device_type: str,
    scale: float | None = None,
    scaler_state: dict | None = None,
    loss: float | None = None,
    loss_dtype: str | None = None,
    grad_norm: float | None = None,
    rank: int = 0,
    world_size: int = 1,
    pre_step_buffers: dict[str, torch.Tensor] | None = None,
    cwd: str | None = None,
    fsdp: dict[str, Any] | None = None,
    optimizer: dict[str, Any] | None = None,
    update: dict[str, Any] | None = None,
    exception: dict[str, Any] | None = None,
    compile: dict[str, Any] | None = None,
    micro_batches: dict[str, Any] | None = None,
    spike: dict[str, Any] | None = None,
    rewind: dict[str, Any] | None = None,
    fp8_recipe: dict[str, Any] | None = None,
    fp8: dict[str, Any] | None = None,
    ddp: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble a snapshot dict (all tensors copied to CPU). Keys: ``schema.SNAPSHOT_KEYS``.

    `pre_step_buffers` holds the values at ``begin_step`` of the buffers the forward mutated in
    place (BatchNorm running statistics, counters): they replace the live, post-forward values
    so that replay starts from the state the failing forward saw. Sharded (DTensor) entries are
    saved as this rank's local shard. `cwd`: the training process's working directory
    (default: the current one). `fsdp`: a sharded model's ``fsdp`` entry (``recorders._fsdp``):
    its weights are in the DCP directory or ``fsdp["local_state"]``, so ``model_state`` is {}.
    `optimizer`: ``recorders._update.optimizer_entry`` (class, CPU state_dict, parameter names) or
    None. `update`: ``recorders._update.update_entry`` on an ``update`` snapshot, whose
    ``model_state`` then holds the weights after the step (it passes no `pre_step_buffers`).
    `exception`: ``recorders._exception.exception_entry`` on an ``exception`` snapshot (strings and ints).
    `compile`: ``recorders.compiled.compile_info`` of the model as the loop passed it, or None.
    `micro_batches`: ``recorders.micro_batches.MicroBatches.entry``: `batch` is then the list of the step's
    micro-batches, each copied to the CPU here (never before), or None.
    `spike`: on a ``loss_spike`` / ``grad_spike`` snapshot, the trigger's evidence (``schema.SPIKE_KEYS``).
    `rewind`: ``recorders._rewind.RewindWindow.entry`` (``schema.REWIND_KEYS``, tensors already on the host), or None.
    `fp8_recipe`, `fp8`: an FP8 model's recipe (``describe_fp8``) and the step's casts (``schema.FP8_KEYS``), or None.
    `ddp`: ``recorders._ddp.ddp_entry`` of the DistributedDataParallel wrapper (``schema.DDP_KEYS``), or None.
    """
    from . import __version__

    state = {}
    if fsdp is None:
        state = {clean_name(k): _local(v).detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        for name, value in (pre_step_buffers or {}).items():
            if name in state:
                state[name] = _local(value).detach().to("cpu", copy=True)

    snap = {
        "format": schema.SNAPSHOT_FORMAT,
        "format_version": schema.FORMAT_VERSION,
        "torch_version": str(torch.__version__),
        "amp_autopsy_version": __version__,
        "created": time.time(),
        "host": socket.gethostname(),
        "rank": int(rank),
        "world_size": int(world_size),
        "step": int(step),
        "reason": str(reason),
        "device_type": str(device_type),
        "amp_dtype": schema.dtype_name(amp_dtype),
        "scale": None if scale is None else float(scale),
        "scaler_state": scaler_state,
        "factory": factory,
        "factory_kwargs": dict(factory_kwargs),
        "loss_fn": loss_fn,
        "train_mode": bool(model.training),
        "model_state": state,
        "batch": to_cpu_tree(batch),
        "rng": rng,
        "loss": None if loss is None else float(loss),
        "loss_dtype": loss_dtype,
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "cwd": current_cwd() if cwd is None else str(cwd),
        "sdpa": sdpa_state(),  # the attention-backend switches, read now (nothing per step)
        "fsdp": fsdp,
        "optimizer": optimizer,
        "update": update,
        "exception": None if exception is None else dict(exception),
        "compile": compile,  # recorders/compiled.compile_info: how training compiled the model
        "micro_batches": None if micro_batches is None else dict(micro_batches),  # recorders/micro_batches.py
        "spike": None if spike is None else {k: spike.get(k) for k in schema.SPIKE_KEYS},  # recorders/_spikes.py
        "rewind": rewind,  # recorders/_rewind.py: Recorder(rewind=K)'s window
        "fp8_recipe": fp8_recipe,  # recorders/fp8_recipe.describe_fp8
        "fp8": None if fp8 is None else {k: fp8.get(k) for k in schema.FP8_KEYS},  # recorders/_fp8_watch.py
        "ddp": None if ddp is None else {k: ddp.get(k) for k in schema.DDP_KEYS},  # recorders/_ddp.py
    }
    assert tuple(snap) == schema.SNAPSHOT_KEYS
    return snap


def write_snapshot(path: str | os.PathLike, snap: dict[str, Any]) -> Path:
    """Write `snap` to `path` atomically (temporary name, fsync, rename)."""
    return atomic_write(path, lambda f: torch.save(snap, f))


def claim_snapshot(directory: str | os.PathLike, snap: dict[str, Any], writer: int = 0) -> Path:
    """Write `snap` under its ``schema.snapshot_name`` in `directory`, never over an existing file.

    A name already taken (a resumed run failing again at the same step, for the same reason)
    gets ``_2``, ``_3``... after the reason, so the earlier process's snapshot is kept.
    """
    directory = Path(directory)
    step, rank, reason = snap["step"], snap["rank"], snap["reason"]

    def name(i: int) -> Path:
        return directory / schema.snapshot_name(step, rank, reason if i == 0 else f"{reason}_{i + 1}", writer)

    return claim_write(name, 0, lambda f: torch.save(snap, f))[0]

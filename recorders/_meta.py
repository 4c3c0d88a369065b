"""The Recorder's validated settings and the run metadata it writes to ``meta.json``."""
from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass

import torch

from . import schema
from .compiled import clean_name
from ._spikes import MIN_BASELINE

__all__ = ["RecorderConfig", "dist_info", "amp_dtype_of", "build_meta", "current_cwd"]


@dataclass(frozen=True)
class RecorderConfig:
    """The Recorder's numeric options; ``__post_init__`` names the bad one."""

    layer_every: int = 1
    flush_every: int = 50
    min_scale: float = 1.0
    overflow_streak: int = 8
    max_snapshots: int = 3
    step_numbering: str = "loop"  # a key of schema.STEP_NUMBERINGS (framework adapters set it)
    micro_batches: int | None = None  # forwards accumulated into one recorded step, when declared
    loss_spike: float | None = 3.0  # snapshot a loss this many times its trailing median (and 7 robust sigmas); None: off
    grad_spike: float | None = 10.0  # the same for the total gradient norm; None: off
    spike_window: int = 100  # trailing steps of the spike baselines (warm-up: half of it)
    max_spike_snapshots: int = 2  # spike snapshots per run and rank, apart from max_snapshots
    fp8_every: int | None = 10  # FP8 modules' casts measured every N-th step; None: never

    def __post_init__(self):
        for name in ("layer_every", "flush_every", "overflow_streak", "fp8_every"):
            value = getattr(self, name)
            if name == "fp8_every" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.max_snapshots, bool) or not isinstance(self.max_snapshots, int) \
                or self.max_snapshots < 0:
            raise ValueError(f"max_snapshots must be an int >= 0, got {self.max_snapshots!r}")
        if not isinstance(self.min_scale, (int, float)) or not self.min_scale >= 0:
            raise ValueError(f"min_scale must be a number >= 0, got {self.min_scale!r}")
        if self.step_numbering not in schema.STEP_NUMBERINGS:
            raise ValueError(f"step_numbering must be one of {sorted(schema.STEP_NUMBERINGS)}, "
                             f"got {self.step_numbering!r}")
        mb = self.micro_batches
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb < 1):
            raise ValueError(f"micro_batches must be None or an int >= 1, got {mb!r}")
        for name in ("loss_spike", "grad_spike"):
            f = getattr(self, name)
            if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 1 < f < math.inf):
                raise ValueError(f"{name} must be None (off) or a finite number > 1 (a factor over the trailing "
                                 f"median), got {f!r}")
        w = self.spike_window
        if isinstance(w, bool) or not isinstance(w, int) or w < MIN_BASELINE:
            raise ValueError(f"spike_window must be an int >= {MIN_BASELINE}, got {w!r}")
        c = self.max_spike_snapshots
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(f"max_spike_snapshots must be an int >= 0, got {c!r}")

    def spike_settings(self) -> dict | None:
        """meta.json's ``spikes`` (``schema.SPIKE_SETTINGS``); None when both spike triggers are off."""
        if self.loss_spike is None and self.grad_spike is None:
            return None
        return {k: getattr(self, k) for k in schema.SPIKE_SETTINGS}


def dist_info() -> tuple[int, int]:
    """(rank, world_size) from torch.distributed when it is initialised, else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def amp_dtype_of(amp_dtype) -> torch.dtype | None:
    """torch.float16 / torch.bfloat16 / None; names like "bf16" work; float32 means no AMP (None)."""
    if isinstance(amp_dtype, str):
        amp_dtype = schema.dtype_from_name(amp_dtype)
    if amp_dtype is None or amp_dtype == torch.float32:
        return None
    if amp_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"amp_dtype must be torch.float16, torch.bfloat16 or None (FP32), got {amp_dtype!r}")
    return amp_dtype


def _tensor_info(named, sharded: bool = False) -> list[dict]:
    """One entry per tensor; under FSDP2 (`sharded`) also where this rank's shard sits.

    ``shape``/``numel`` are the whole tensor's (a DTensor's global shape); ``sharded``,
    ``local_shape``, ``local_numel``, ``local_offset`` (version 3) let the analyzer weight and
    merge the ranks' shard statistics.
    """
    from ._fsdp import shard_layout

    out = []
    for i, (n, t) in enumerate(named):
        entry = {"name": clean_name(n), "shape": list(t.shape), "numel": t.numel(), "dtype": schema.dtype_name(t.dtype),
                 "depth": i}
        if sharded:
            layout = shard_layout(t)
            entry["sharded"] = layout is not None
            entry.update(layout or {"local_shape": list(t.shape), "local_numel": t.numel(), "local_offset": None})
        out.append(entry)
    return out


def _scaler_config(scaler: torch.amp.GradScaler | None) -> dict | None:
    """The scaler's configuration: its state_dict without the live scale and growth tracker."""
    if scaler is None:
        return None
    config = {k: v for k, v in scaler.state_dict().items() if k not in ("scale", "_growth_tracker")}
    config["init_scale"] = float(scaler._init_scale)
    return config


def current_cwd() -> str | None:
    """os.getcwd(), which replay names (never imports from) when the user's code is found only there; None if deleted."""
    try:
        return os.getcwd()
    except OSError:
        return None


def build_meta(*, model: torch.nn.Module, rank: int, world_size: int, device_type: str,
               amp_dtype: torch.dtype | None, scaler: torch.amp.GradScaler | None, factory: str | None,
               factory_kwargs: dict, loss_fn: str | None, config: RecorderConfig,
               fsdp: dict | None = None, optimizer: dict | None = None, compile: dict | None = None,
               warnings: list[dict] | None = None, fp8_recipe: dict | None = None, fp8: dict | None = None,
               ddp: dict | None = None) -> dict:
    """The ``meta.json`` dict, keys ``schema.META_KEYS`` in order.

    `fsdp`: ``recorders._fsdp.fsdp_meta`` of a sharded model (policy, mesh), else None.
    `optimizer`: ``recorders._update.optimizer_meta`` (class, hyperparameters per group) or None.
    `compile`: ``recorders.compiled.compile_info`` (how it was torch.compile'd) or None.
    `warnings`: the RecorderWarnings issued before meta.json was first written (``schema.WARNING_KEYS`` dicts).
    `fp8_recipe`, `fp8`: ``describe_fp8(model)`` and the FP8 statistics' settings (``recorders._fp8_watch``), or None.
    `ddp`: ``recorders._ddp.ddp_entry`` of a DistributedDataParallel wrapper (``schema.DDP_KEYS``), or None.
    """
    from . import __version__

    meta = {
        "format": schema.META_FORMAT,
        "format_version": schema.FORMAT_VERSION,
        "torch_version": torch.__version__,
        "amp_autopsy_version": __version__,
        "created": time.time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": rank,
        "world_size": world_size,
        "device_type": device_type,
        "amp_dtype": schema.dtype_name(amp_dtype),
        "scaler": _scaler_config(scaler),
        "params": _tensor_info(model.named_parameters(), sharded=fsdp is not None),
        "buffers": _tensor_info(model.named_buffers()),
        "factory": factory,
        "factory_kwargs": factory_kwargs,
        "loss_fn": loss_fn,
        "layer_every": config.layer_every,
        "flush_every": config.flush_every,
        "cwd": current_cwd(),
        "fsdp": fsdp,
        "optimizer": optimizer,
        "step_numbering": config.step_numbering,
        "micro_batches": config.micro_batches,
        "exception": None,  # Recorder.__exit__ fills it in when the loop raises (recorders/_exception.py)
        "steps_begun": 0,  # rewritten at close (and when a step began and never ended)
        "autocast": None,  # rewritten after the first recorded step (recorders/_mistakes.py)
        "compile": compile,  # recorders/compiled.compile_info of the model the loop passed
        "micro_batches_kept": None,  # set once snapshots hold every micro-batch (recorders/micro_batches.py)
        "warnings": list(warnings or []),  # rewritten at each RecorderWarning (recorders/_lifecycle.py)
        "spikes": config.spike_settings(),  # the spike triggers' settings (recorders/_spikes.py)
        "fp8_recipe": fp8_recipe,  # recorders/fp8_recipe.describe_fp8: the torchao FP8 recipe
        "fp8": fp8,  # the FP8 statistics' settings (recorders/_fp8_watch.py)
        "ddp": ddp,  # recorders/_ddp.py: what shapes DDP's gradient all-reduce
    }
    assert tuple(meta) == schema.META_KEYS
    return meta

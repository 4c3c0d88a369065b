"""One rank's rebuilt model in the distributed replay of a DDP snapshot: whole weights, DDP's all-reduce visible.

DDP replicates the model: every rank loads the whole weights from its own snapshot file. DDP's C++ reducer
all-reduces the gradients where no dispatch mode sees it, so ``ReplicatedContext`` reduces them as the
recorded communication hook (the snapshot's ``ddp`` entry, ``recorders.schema.DDP_KEYS``) does, in Python,
from each parameter's post-accumulate-grad hook: every op of the reduction, ``c10d.allreduce_`` included,
runs under the dispatch mode, inside a ``DDP::reduce`` region whose ops (the cast, the division, the copy
back) are plumbing, never a culprit. A collective's input is then the gradient as the hook got it.

The numerics are torch's built-in hooks' (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``),
elementwise the same per parameter as per bucket:

- no hook or ``allreduce_hook``: the gradient divided by the world size, then summed in its own dtype;
- ``fp16_compress_hook`` / ``bf16_compress_hook``: cast to FP16/BF16, divided by the world size, summed in
  that dtype, copied back (a rank's gradient beyond FP16's 65504 is inf before the sum).

The FP32 run (the reference) and a fix's run (``reduce_override="float32"``) reduce as ``allreduce_hook``
in FP32. With ``broadcast_buffers`` (DDP's default) rank 0's buffers replace every rank's before the step,
as DDP's forward does.

NB: not DDP itself: no buckets (the sums are elementwise, so their values are the same), and the Python
hook never overlaps backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

import torch

from recorders import schema

from ...errors import BadInputError
from .sharded import ShardedContext

__all__ = ["ReplicatedContext", "ddp_entry_of", "FIX_TITLE"]

FIX_TITLE = "the all-reduce in FP32: DDP without a compress hook (or allreduce_hook)"


def ddp_entry_of(path: str, ddp: Any) -> dict[str, Any]:
    """The snapshot's ``ddp`` entry if the distributed replay can reduce as it says; else one BadInputError."""
    hook = ddp.get("comm_hook")
    if hook == "unknown" or ddp.get("divide") != "before":
        name = ddp.get("comm_hook_name") or "unreadable"
        raise BadInputError(f"DDP's communication hook ({name}) is not one of torch's built-in hooks, so the "
                            "distributed replay cannot reduce the gradients as training did"[:300], path=path,
                            fix="replay it in one process: analyzer replay SNAPSHOT (--rank R for another "
                                "rank's), without torchrun")
    if ddp.get("mixed_precision") is not None:
        raise BadInputError("the run used DDP's mixed_precision config, which the distributed replay does not "
                            "rebuild", path=path, fix="replay it in one process: analyzer replay SNAPSHOT, "
                                                      "without torchrun")
    return ddp


@dataclass
class ReplicatedContext(ShardedContext):
    """A rank's ``ReplayContext`` for a DDP snapshot: whole weights, the gradients all-reduced as recorded."""

    ddp: dict = field(default_factory=dict)  # the snapshot's ddp entry (schema.DDP_KEYS)
    _handles: list = field(default_factory=list, repr=False)
    _sources: dict = field(default_factory=dict, repr=False)  # all-reduce op index -> the hook's first op
    _names: dict = field(default_factory=dict, repr=False)  # all-reduce op index -> the parameter's name
    _sync: bool = True
    _reduce_dtype: torch.dtype | None = None
    reduce_fp32_title: ClassVar[str] = FIX_TITLE

    def build_model(self, precision: str | None = None) -> torch.nn.Module:
        """The model with this rank's snapshot weights (kept between runs) and the reduction hooks of `precision`."""
        if self.follow is not None:
            self.follow.begin(precision)
        for h in self._handles:
            h.remove()
        self._handles, self._sources, self._names, self._sync = [], {}, {}, True
        model = super(ShardedContext, self).build_model(precision)
        if self.ddp.get("broadcast_buffers") is not False:
            for b in model.buffers():  # NB: collective, before the step: DDP's forward does the same
                torch.distributed.broadcast(b.data, src=0)
        name = self.ddp.get("reduce_dtype")
        low = precision is not None and precision != "float32" and self.reduce_override is None
        self._reduce_dtype = schema.dtype_from_name(name) if low and name is not None else None
        for n, p in model.named_parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(partial(self._reduce, n)))
        return model

    def _reduce(self, name: str, param: torch.Tensor) -> None:
        """The recorded hook's reduction of one gradient, every op under the dispatch mode."""
        if not self._sync or param.grad is None:
            return
        grad = param.grad
        mode = self.last_mode
        with torch.profiler.record_function("DDP::reduce"):
            first = len(mode.records)
            buf = grad.to(self._reduce_dtype) if self._reduce_dtype is not None else grad
            buf.div_(torch.distributed.get_world_size())
            at = len(mode.records)
            torch.distributed.all_reduce(buf)
            if buf is not grad:
                grad.copy_(buf)
        self._sources[at], self._names[at] = first, name

    def before_micro_batch(self, model: torch.nn.Module, last: bool) -> None:
        """DDP's ``no_sync`` until the last micro-batch: the accumulated gradients are reduced once."""
        self._sync = last

    def collective_modules(self) -> dict[int, str]:
        """Op index of each all-reduce of the last run -> the parameter whose gradient it reduced."""
        return dict(self._names)

    def collective_sources(self) -> dict[int, int]:
        """Op index of each all-reduce -> the hook's first op, whose input is the gradient the hook got."""
        return dict(self._sources)

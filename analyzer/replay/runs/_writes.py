"""Which buffers a replayed step reads, and which it only writes (BatchNorm's running statistics).

A snapshot taken after the forward holds the buffers that forward already wrote. A train-mode
BatchNorm writes NaN into ``running_mean``/``running_var`` when its input overflowed, but its
output never depends on them: they are the step's *output*, not its input, and a NaN there
must not be blamed as a non-finite input.

Two pieces decide it:

- ``unread_args``: the ops whose running-statistics arguments are never read into an output:
  batch norm in training mode, forward (which updates them in place) and backward (which is
  handed them but uses the batch statistics), in every ATen spelling. This is the one place
  that needs knowledge of ops; everything else follows from data flow.
- ``BufferReads``: follows the values of the watched buffers through one replayed run. An op
  with a watched value among its inputs passes it on to its outputs and to every argument it
  writes in place (``buf.mul_(0.9).add_(x)`` keeps an EMA inside the buffer). A buffer is *read*
  when its value reaches the loss or any backward op; otherwise the step only writes it.

Example:
    >>> reads = BufferReads({"bn.running_mean": model.bn.running_mean})  # doctest: +SKIP
    >>> # ... run the step under _OpStatsMode(reads=reads) ...
    >>> reads.read  # doctest: +SKIP
    set()
"""
from __future__ import annotations

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ._cache import Memo

__all__: list[str] = []

# op name -> the boolean argument that says "training", or None when the op always updates.
# NB: the eval-mode spellings (_native_batch_norm_legit_no_training, _batch_norm_no_update)
# read the running statistics and are deliberately absent.
_RUNNING_STATS_OPS: dict[str, str | None] = {
    "aten.native_batch_norm": "training",
    "aten._native_batch_norm_legit": "training",
    "aten._native_batch_norm_legit_functional": "training",
    "aten.cudnn_batch_norm": "training",
    "aten.miopen_batch_norm": "training",
    "aten._batch_norm_with_update": None,
    "aten._batch_norm_with_update_functional": None,
    "aten.batch_norm_update_stats": None,
    "aten.batch_norm_gather_stats": None,
    "aten.batch_norm_gather_stats_with_counts": None,
    "aten.native_batch_norm_backward": "train",
    "aten.batch_norm_backward": "update",
    "aten.cudnn_batch_norm_backward": None,   # cuDNN/MIOpen backward exist for training only
    "aten.miopen_batch_norm_backward": None,
}
_STATS_ARGS = ("running_mean", "running_var")
# Collectives and FSDP2's copy ops: the buffer each one fills is handed in empty (uninitialised memory),
# never read; the c10d schemas do not mark it written (no ``Tensor(a!)``).
_FILLED_ARGS: dict[str, tuple[str, ...]] = {
    "c10d._reduce_scatter_base_": ("output_tensor",),
    "c10d._allgather_base_": ("output_tensor",),
    "c10d.reduce_scatter_": ("output_tensors",),
    "c10d.allgather_": ("output_tensors",),
    "c10d.allgather_into_tensor_coalesced_": ("outputs",),
    "c10d.reduce_scatter_tensor_coalesced_": ("outputs",),
    "fsdp.all_gather_copy_in": ("all_gather_output",),
    "fsdp.split_with_sizes_copy": ("out",),
    "fsdp.chunk_cat": ("out",),
}
_WRITTEN = Memo()  # OpOverload -> argument positions its schema marks as written (Tensor(a!))


def _arg(func, args, kwargs, name: str):
    if name in kwargs:
        return kwargs[name]
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else None
    return None


def unread_args(name: str, func, args, kwargs) -> list[torch.Tensor]:
    """The tensor arguments of this call that the op never reads into an output (it may write them)."""
    filled = _FILLED_ARGS.get(name)
    if filled is not None:
        found = [_arg(func, args, kwargs, n) for n in filled]
        return [t for a in found for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
    if name not in _RUNNING_STATS_OPS:
        return []
    training = _RUNNING_STATS_OPS[name]
    if training is not None and not _arg(func, args, kwargs, training):
        return []
    found = (_arg(func, args, kwargs, n) for n in _STATS_ARGS)
    return [t for t in found if isinstance(t, torch.Tensor)]


def written_args(func, args, kwargs) -> list[torch.Tensor]:
    """The tensor arguments the op's schema marks as written in place (``Tensor(a!)``)."""
    positions = _WRITTEN.get(func)
    if positions is None:
        positions = _WRITTEN[func] = tuple(
            (i, a.name) for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write)
    out = []
    for i, n in positions:
        t = kwargs.get(n) if n in kwargs else (args[i] if i < len(args) else None)
        if isinstance(t, torch.Tensor):
            out.append(t)
    return out


class BufferReads:
    """Follow watched buffers' values through one run's ops; ``read`` names those that matter.

    Args:
        watched: buffer name -> the model's buffer tensor (the very object the forward uses).
    """

    def __init__(self, watched: dict[str, torch.Tensor]):
        self._taint: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        for name, t in watched.items():
            self._taint[t] = self._taint.get(t, frozenset()) | {name}
        self.read: set[str] = set()

    def op(self, func, args, kwargs, tensors_in: list[torch.Tensor], skip: list[torch.Tensor],
           out_flat: list, backward: bool) -> None:
        """Propagate after one op. `skip` are its unread arguments (their values go nowhere)."""
        skip_ids = {id(t) for t in skip}
        names: frozenset = frozenset()
        for t in tensors_in:
            if id(t) not in skip_ids:
                names = names | self._taint.get(t, frozenset())
        if not names:
            return
        if backward:  # a watched value feeds the gradients
            self.read |= names
        for t in [o for o in out_flat if isinstance(o, torch.Tensor)] + written_args(func, args, kwargs):
            self._mark(t, names)
            base = t._base
            if base is not None:  # an in-place write through a view changes its base too
                self._mark(base, names)

    def _mark(self, t: torch.Tensor, names: frozenset) -> None:
        self._taint[t] = self._taint.get(t, frozenset()) | names

    def finish(self, loss: torch.Tensor) -> None:
        """A watched value that reached the loss was read by the step."""
        self.read |= self._taint.get(loss, frozenset())

"""Pre-step copies of the buffers a forward mutates in place, so snapshots hold the state it saw.

A train-mode BatchNorm writes ``running_mean``/``running_var``/``num_batches_tracked`` during
the forward; a snapshot taken at ``end_step`` would otherwise hold the post-forward values
(NaN, when the failing forward poisoned them), and replay would blame the buffer.

Which buffers a step mutates: the first step copies every buffer and, at its end, compares
each copy with the live value (one host sync, once per run). Later steps copy only the
buffers found mutated, plus any whose version counter (``t._version``) moved since. The
counters alone are not enough: BatchNorm's kernel writes ``running_mean``/``running_var``
without bumping them (torch 2.13, CPU), only ``num_batches_tracked += 1`` does. The copies
are device-to-device into preallocated tensors: no host sync, no allocation after step one.

NB: a buffer that no forward wrote during the first step but one writes later without a
version bump (a BatchNorm first run in train mode after eval steps) is missed until a step
reveals it; the snapshot then holds its post-forward value, and the recorder warns.
"""
from __future__ import annotations

import torch

from .compiled import clean_name

__all__ = ["BufferTracker"]


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


class BufferTracker:
    """Keeps the begin_step values of the model's in-place-mutated buffers.

    Example:
        >>> tracker = BufferTracker(model)            # doctest: +SKIP
        >>> tracker.begin()                           # before the forward
        >>> loss = model(x).sum()                     # BatchNorm writes its running stats
        >>> pre, missed = tracker.pre_step()          # their values at begin()
    """

    def __init__(self, model: torch.nn.Module):
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        for name, buf in model.named_buffers():
            self.names.append(clean_name(name))
            self.tensors.append(buf)
        self.watch: list[int] | None = None  # None: not known yet, copy all
        self.copies: dict[int, torch.Tensor] = {}
        self.versions: list[int | None] = []

    def begin(self) -> None:
        """Copy the buffers that may be mutated (all, before the first step) and note versions."""
        watch = range(len(self.tensors)) if self.watch is None else self.watch
        dst, src = [], []
        for i in watch:
            t = self.tensors[i]
            copy = self.copies.get(i)
            if copy is None or copy.shape != t.shape or copy.dtype != t.dtype or copy.device != t.device:
                # NB: allocated once per buffer; later steps copy into it
                copy = self.copies[i] = torch.empty_like(t, memory_format=torch.preserve_format)
            dst.append(copy)
            src.append(t.detach())
        if dst:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)  # device to device: no host sync
        self.versions = [_version(t) for t in self.tensors]

    def mutated(self) -> list[int]:
        """Indices of the buffers written in place since ``begin``."""
        return [i for i, (t, v) in enumerate(zip(self.tensors, self.versions))
                if v is not None and _version(t) != v]

    def pre_step(self) -> tuple[dict[str, torch.Tensor], list[str]]:
        """({name: begin() value} of every copied buffer, names written since begin() without a copy)."""
        pre = {self.names[i]: copy for i, copy in self.copies.items()}
        missed = [self.names[i] for i in self.mutated() if i not in self.copies]
        return pre, missed

    def _changed_values(self) -> set[int]:
        """Buffers whose value differs from their begin() copy (NaN counts as changed)."""
        idx = [i for i in self.copies if self.tensors[i].numel()]
        if not idx:
            return set()
        device = self.tensors[idx[0]].device
        with torch.no_grad():
            flags = torch.stack([(self.copies[i] != self.tensors[i]).any().to(device) for i in idx])
        # NB: host sync, once per run: the end of the first step
        return {i for i, changed in zip(idx, flags.tolist()) if changed}

    def end(self) -> None:
        """Learn from this step which buffers to copy from now on; free the other copies."""
        if not self.versions:
            return
        seen = set(self.mutated()) | set(self.watch or ())
        if self.watch is None:
            seen |= self._changed_values()
        self.watch = sorted(seen)
        for i in list(self.copies):
            if i not in seen:
                del self.copies[i]

"""Walk a tensor's elements as 1-D chunks without materialising it: memory order, bounded copies.

A tensor from ``torch.load(mmap=True)`` or a safetensors file is a view of the file. Dense tensors
(any dimension order) are walked as slices of one flat view, no copy. A view with gaps (a slice saved
with its whole storage) is walked row block by row block, each block copied (at most ``chunk``
elements). A view whose elements overlap (an ``expand``ed tensor: stride 0; or strides smaller than
the block below them) would repeat values without end: a 12-byte storage can declare 3e9 elements.
Its stride-0 dimensions are dropped (its distinct values are what the statistics describe), and any
other overlap is walked through the storage span it covers.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["pieces", "pair_pieces", "scanned_numel", "distinct"]


def _broadcast_dims(t: torch.Tensor) -> frozenset[int]:
    return frozenset(d for d in range(t.dim()) if t.stride(d) == 0 and t.shape[d] > 1)


def _drop(t: torch.Tensor, dims: frozenset[int]) -> torch.Tensor:
    """t with every dimension in `dims` reduced to its index 0 (and removed)."""
    for d in sorted(dims, reverse=True):
        t = t.select(d, 0)
    return t


def _memory_order(t: torch.Tensor) -> list[int]:
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


def _extent(t: torch.Tensor) -> tuple[int, bool]:
    """(elements of storage the view spans, whether its elements overlap)."""
    extent, overlap = 1, False
    for d in reversed(_memory_order(t)):
        size, stride = t.shape[d], t.stride(d)
        if size > 1:
            overlap = overlap or stride < extent
            extent += stride * (size - 1)
    return extent, overlap


def distinct(t: torch.Tensor) -> torch.Tensor:
    """t's distinct elements as a tensor walkable without repeats: broadcast dims dropped, then either
    t in memory order or, if its elements still overlap, the storage span it covers (1-D)."""
    t = _drop(t, _broadcast_dims(t))
    if t.numel() == 0:
        return t.reshape(0)
    extent, overlap = _extent(t)
    if overlap:
        return t.as_strided((extent,), (1,), t.storage_offset())
    return t.permute(_memory_order(t))


def scanned_numel(t: torch.Tensor) -> int:
    """How many elements ``pieces(t)`` yields: t.numel() unless t's elements overlap."""
    if t.is_contiguous():  # no broadcast dimension, no overlap: every element once (an empty tensor: 0)
        return t.numel()
    return distinct(t).numel()


def _split(ts: tuple[torch.Tensor, ...], chunk: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """Aligned 1-D chunks of same-shaped tensors: element i of each chunk is the same index of each."""
    n = ts[0].numel()
    if n == 0:
        return
    if all(t.is_contiguous() for t in ts):
        flats = [t.view(-1) for t in ts]
        for i in range(0, n, chunk):
            yield tuple(f[i:i + chunk] for f in flats)
    elif n <= chunk:
        yield tuple(t.reshape(-1) for t in ts)  # NB: copies at most `chunk` elements
    else:
        rows = max(1, chunk // (n // ts[0].shape[0]))
        for i in range(0, ts[0].shape[0], rows):
            sub = tuple(t[i:i + rows] for t in ts)
            yield from _split(tuple(s[0] for s in sub) if rows == 1 else sub, chunk)


def pieces(t: torch.Tensor, chunk: int) -> Iterator[torch.Tensor]:
    """t's distinct elements as 1-D chunks of at most `chunk` elements, in memory order.

    Example:
        >>> [p.tolist() for p in pieces(torch.arange(6.0).view(2, 3).t(), 4)]
        [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]]
    """
    for (p,) in _split((distinct(t),), chunk):
        yield p


def pair_pieces(ta: torch.Tensor, tb: torch.Tensor, chunk: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]] | None:
    """Aligned chunks of two same-shaped tensors, in A's memory order; None when they cannot be
    walked together without materialising a view (broadcast along different dims, or overlapping)."""
    dims = _broadcast_dims(ta)
    if dims != _broadcast_dims(tb):
        return None
    ta, tb = _drop(ta, dims), _drop(tb, dims)
    if _extent(ta)[1] or _extent(tb)[1]:
        return None
    order = _memory_order(ta)
    return _split((ta.permute(order), tb.permute(order)), chunk)

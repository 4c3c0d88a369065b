"""Float32 L2 norms of many tensors, and their exact zero counts, with one read of their memory.

The Recorder's per-layer statistics were three passes over memory per recorded step: a
``_foreach_norm`` of the gradients, one of the parameters, and a ``count_nonzero`` per gradient,
which is a scalar loop on CPU (~2.5x a norm). ``GradPass`` fuses the gradient norm and the zero
count on CPU: each float32 gradient is cut into pieces of ``CHUNK`` elements that fit in L2, and
while a piece is in cache it is reduced twice with vectorised kernels: its float32 L2 norm (the
kernel ``_foreach_norm`` runs per tensor on CPU) and its number of non-zeros (``torch.dot(s, s)``
with ``s = sign(p)``: every term is 0 or 1, so the float32 sum is an exact integer below 2**24).
Steps without a layer row take the norms alone, of the same pieces, with one ``_foreach_norm``:
the same values. Pieces' squared norms are summed per tensor in float64. Tensors of at most
``SMALL`` elements (biases, norms' weights) skip the pieces: one ``_foreach_norm`` for all of
them and a ``count_nonzero`` each, cheaper than three dispatches per tensor.

NB: a tensor of at most ``CHUNK`` elements keeps its ``_foreach_norm`` value bit for bit; a
larger one gets a norm more accurate than one float32 sum over the whole tensor (~5e-4 relative
error on 3M elements), so it differs from the old value in the last digits. A piece whose float32
sum of squares overflows gives an infinite norm, as ``_foreach_norm`` does, and the Recorder's
cold path measures it in float64. The zero count of a piece holding NaN is wrong (``sign(NaN)``
is 0 or NaN depending on the kernel): the Recorder recounts failing steps, where a NaN makes the
norm NaN, with ``count_nonzero``. Other devices and dtypes (CUDA's fused kernels, FP16/BF16
gradients) keep ``_foreach_norm`` and ``count_nonzero``.

Example:
    >>> grads = [torch.tensor([3.0, 0.0, 4.0]), torch.zeros(2)]
    >>> norm, nonzero = GradPass()(grads, torch.device("cpu"), True, zeros=True)
    >>> norm.tolist(), nonzero.tolist()
    ([5.0, 0.0], [2.0, 0.0])
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["CHUNK", "SMALL", "norms", "nonzero_counts", "GradPass"]

CHUNK = 1 << 17  # elements per piece: 512 KiB of float32, read once from memory, then twice from L2
SMALL = 1 << 13  # tensors up to this size: one _foreach_norm for all, and count_nonzero (~1 ns per element)


def norms(tensors: list[torch.Tensor], device: torch.device, single_device: bool) -> torch.Tensor:
    """Float32 L2 norm of each tensor, stacked on `device`; one fused kernel when possible.

    NB: a float64 tensor is measured in float64, then rounded: a float32 ``dtype`` would be a
    narrowing that ``vector_norm`` refuses (it stopped the recording of float64 models).
    """
    if single_device and all(t.dtype != torch.float64 for t in tensors):
        return torch.stack(torch._foreach_norm(tensors, 2, torch.float32))
    return torch.stack([torch.linalg.vector_norm(t, dtype=None if t.dtype == torch.float64 else torch.float32)
                        .to(device, torch.float32) for t in tensors])


def _fast(tensors: list[torch.Tensor], device: torch.device, single_device: bool) -> bool:
    """Whether the piecewise CPU pass applies: strided float32 tensors on the CPU."""
    return single_device and device.type == "cpu" and all(
        t.dtype == torch.float32 and t.layout == torch.strided for t in tensors)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as one dimension, in memory order: a view when `t` is dense in any dim order
    (contiguous, channels_last), else a copy. Norms and counts do not depend on the order."""
    if t.is_contiguous():
        return t.view(-1)
    dense = t.permute(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return dense.view(-1) if dense.is_contiguous() else t.reshape(-1)


def nonzero_counts(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Each tensor's exact non-zero count, int64 on `device` (MPS has no float64), one
    ``count_nonzero`` per tensor: ~2.5x one L2 norm per element; ``(g == 0).sum()`` is 10-40x (bool)."""
    return torch.stack([torch.count_nonzero(t).to(device) for t in tensors])


class GradPass:
    """Per-tensor float32 L2 norms and, with ``zeros=True``, exact non-zero counts.

    The counts are float64 from the CPU pass and int64 from the fallback (``count_nonzero``).

    Holds a scratch buffer of ``CHUNK`` elements per torch thread for the signs (allocated at the
    first call, touched once: first-touch page faults make a fresh buffer ~3x slower) and the
    last piece layouts.
    """

    def __init__(self):
        self._scratch: torch.Tensor | None = None
        self._layouts: dict[str, tuple[tuple[int, ...], Any]] = {}

    def __call__(self, tensors: list[torch.Tensor], device: torch.device, single_device: bool,
                 zeros: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(norms float32 on `device`, non-zero counts on `device` or None)."""
        if not _fast(tensors, device, single_device):
            return norms(tensors, device, single_device), nonzero_counts(tensors, device) if zeros else None
        if not tensors:
            empty = torch.empty(0, device=device)
            return empty, (empty.double() if zeros else None)
        small, large = self._split(tensors)
        norm = torch.empty(len(tensors), dtype=torch.float32)
        nnz = torch.empty(len(tensors), dtype=torch.float64) if zeros else None
        if small[0]:  # one _foreach_norm; count_nonzero's scalar loop beats three dispatches on a few thousand
            few = [tensors[i] for i in small[0]]
            norm.index_copy_(0, small[1], torch.stack(torch._foreach_norm(few, 2, torch.float32)))
            if zeros:
                nnz.index_copy_(0, small[1], torch.stack([torch.count_nonzero(t) for t in few]).double())
        if large[0]:
            many = [tensors[i] for i in large[0]]
            if zeros:
                piece_norm, nonzero, groups_of, pieces_of = self._fused(many)
                nnz.index_copy_(0, large[1], torch.segment_reduce(
                    nonzero.double(), "sum", lengths=self._lengths("groups", groups_of), unsafe=True))
            else:
                pieces, pieces_of = [], []
                for t in many:
                    flat = _flat(t)
                    cut = flat.split(CHUNK) if flat.numel() > CHUNK else (flat,)
                    pieces.extend(cut)
                    pieces_of.append(len(cut))
                piece_norm = torch.stack(torch._foreach_norm(pieces))
            # NB: a float32 squared is exact in float64: a tensor of one piece keeps its float32 norm bit for bit
            total = torch.segment_reduce(piece_norm.double().square_(), "sum",
                                         lengths=self._lengths("pieces", pieces_of), unsafe=True)
            norm.index_copy_(0, large[1], total.sqrt_().float())
        return norm, nnz

    def _split(self, tensors: list[torch.Tensor]) -> tuple[tuple[list[int], torch.Tensor], ...]:
        """(indices, index tensor) of the tensors of at most ``SMALL`` elements, and of the others; cached."""
        key = tuple(t.numel() for t in tensors)
        cached = self._layouts.get("split")
        if cached is None or cached[0] != key:
            small = [i for i, n in enumerate(key) if n <= SMALL]
            large = [i for i, n in enumerate(key) if n > SMALL]
            cached = self._layouts["split"] = (key, ((small, torch.tensor(small, dtype=torch.long)),
                                                     (large, torch.tensor(large, dtype=torch.long))))
        return cached[1]

    def _fused(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        """(each piece's float32 norm, each group's non-zero count, groups and pieces per tensor).

        One thread: each piece is reduced alone (a group of one). More threads: a tensor's full
        pieces are the rows of a ``(k, CHUNK)`` view, taken ``threads`` rows at a time, so that
        each thread reduces its own row into its own L2 (a row norm along ``dim=1`` is the same
        value as the norm of the row alone, whatever the thread count), then the signs of the
        same rows are written over the scratch buffer and counted from cache; the rest (under
        ``CHUNK`` elements, or an empty tensor) is one more piece.
        """
        # at most 64 rows a block: a block's count, up to 2**23, stays an exact float32 sum
        threads = min(max(1, torch.get_num_threads()), 64)
        if self._scratch is None or self._scratch.numel() < threads * CHUNK:
            self._scratch = torch.zeros(threads * CHUNK, dtype=torch.float32)
        scratch = self._scratch
        if threads == 1:
            piece_norms, nonzero, pieces_of = [], [], []
            for t in tensors:
                flat = _flat(t)
                cut = flat.split(CHUNK) if flat.numel() > CHUNK else (flat,)
                pieces_of.append(len(cut))
                for p in cut:
                    piece_norms.append(torch.linalg.vector_norm(p))  # the kernel _foreach_norm runs per tensor
                    # p is in L2 now: the second read costs no memory traffic
                    signs = torch.sign(p, out=scratch if p.numel() == CHUNK else scratch[:p.numel()])
                    nonzero.append(torch.dot(signs, signs))
            return torch.stack(piece_norms), torch.stack(nonzero), pieces_of, pieces_of
        piece_norms, nonzero, groups_of, pieces_of = [], [], [], []
        for t in tensors:
            flat = _flat(t)
            n = flat.numel()
            k, rest = divmod(n, CHUNK)
            groups = 0
            if k:
                for block in flat[:k * CHUNK].view(k, CHUNK).split(threads):
                    piece_norms.append(torch.linalg.vector_norm(block, dim=1))
                    signs = torch.sign(block, out=scratch[:block.numel()].view(block.shape)).view(-1)
                    nonzero.append(torch.dot(signs, signs).reshape(1))
                    groups += 1
            if rest or not n:
                tail = flat[k * CHUNK:]
                piece_norms.append(torch.linalg.vector_norm(tail).reshape(1))
                signs = torch.sign(tail, out=scratch[:rest])
                nonzero.append(torch.dot(signs, signs).reshape(1))
                groups += 1
            groups_of.append(groups)
            pieces_of.append(k + (1 if rest or not n else 0))
        return torch.cat(piece_norms), torch.cat(nonzero), groups_of, pieces_of

    def _lengths(self, kind: str, counts: list[int]) -> torch.Tensor:
        """Pieces (or groups) per tensor as a tensor, cached: the layout repeats every step."""
        key = tuple(counts)
        cached = self._layouts.get(kind)
        if cached is None or cached[0] != key:
            cached = self._layouts[kind] = (key, torch.tensor(key, dtype=torch.long))
        return cached[1]

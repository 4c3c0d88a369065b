"""Float32 L2 norms of many tensors, and their exact zero counts, with one read of their memory.

The Recorder's per-layer statistics were three passes over memory per recorded step: a
``_foreach_norm`` of the gradients, one of the parameters, and a ``count_nonzero`` per gradient,
which is a scalar loop on CPU (~2.5x a norm). ``GradPass`` fuses the gradient norm and the zero
count on CPU: each float32 gradient is cut into pieces of ``CHUNK`` elements that fit in L2, and
while a piece is in cache it is reduced twice with vectorised kernels: its float32 L2 norm (the
kernel ``_foreach_norm`` runs per tensor on CPU) and its number of non-zeros (``torch.dot(s, s)``
with ``s = sign(p)``: every term is 0 or 1, so the float32 sum is an exact integer below 2**24).
Steps without a layer row take the norms alone, of the same pieces, with one ``_foreach_norm``:
the same values. Pieces' squared norms are summed per tensor in float64.

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

import torch

__all__ = ["CHUNK", "norms", "GradPass"]

CHUNK = 1 << 17  # elements per piece: 512 KiB of float32, read once from memory, then twice from L2


def norms(tensors: list[torch.Tensor], device: torch.device, single_device: bool) -> torch.Tensor:
    """Float32 L2 norm of each tensor, stacked on `device`; one fused kernel when possible."""
    if single_device:
        return torch.stack(torch._foreach_norm(tensors, 2, torch.float32))
    return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32).to(device) for t in tensors])


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


class GradPass:
    """Per-tensor float32 L2 norms and, with ``zeros=True``, non-zero counts (float64, exact).

    Holds a ``CHUNK``-element scratch buffer for the signs (allocated at the first call, touched
    once: first-touch page faults make a fresh buffer ~3x slower) and the last piece layout.
    """

    def __init__(self):
        self._scratch: torch.Tensor | None = None
        self._layout: tuple[tuple[int, ...], torch.Tensor | None] = ((), None)

    def __call__(self, tensors: list[torch.Tensor], device: torch.device, single_device: bool,
                 zeros: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(norms float32 on `device`, non-zero counts float64 on `device` or None)."""
        if not _fast(tensors, device, single_device):
            nnz = None
            if zeros:  # count_nonzero is ~2.5x one L2 norm per element; `(g == 0).sum()` is 10-40x (bool)
                nnz = torch.stack([torch.count_nonzero(t).to(device) for t in tensors]).to(torch.float64)
            return norms(tensors, device, single_device), nnz
        if not tensors:
            empty = torch.empty(0, device=device)
            return empty, (empty.double() if zeros else None)
        if self._scratch is None:
            self._scratch = torch.zeros(CHUNK, dtype=torch.float32)
        pieces: list[torch.Tensor] = []
        pieces_of: list[int] = []
        for t in tensors:
            flat = _flat(t)
            cut = flat.split(CHUNK) if flat.numel() > CHUNK else (flat,)
            pieces.extend(cut)
            pieces_of.append(len(cut))
        nnz = None
        if zeros:
            scratch = self._scratch
            piece_norms, nonzero = [], []
            for p in pieces:
                piece_norms.append(torch.linalg.vector_norm(p))  # the kernel _foreach_norm runs per tensor on CPU
                # p is in L2 now: the second read costs no memory traffic
                s = torch.sign(p, out=scratch if p.numel() == CHUNK else scratch[:p.numel()])
                nonzero.append(torch.dot(s, s))
            piece_norm = torch.stack(piece_norms)
        else:
            piece_norm = torch.stack(torch._foreach_norm(pieces))
        lengths = self._lengths(tuple(pieces_of))
        if zeros:
            nnz = torch.segment_reduce(torch.stack(nonzero).double(), "sum", lengths=lengths, unsafe=True)
        # NB: a float32 squared is exact in float64, so a tensor of one piece keeps its float32 norm bit for bit
        total = torch.segment_reduce(piece_norm.double().square_(), "sum", lengths=lengths, unsafe=True)
        return total.sqrt_().float(), nnz

    def _lengths(self, key: tuple[int, ...]) -> torch.Tensor:
        """Pieces per tensor as a tensor, cached: the layout repeats every step."""
        if self._layout[0] != key:
            self._layout = (key, torch.tensor(key, dtype=torch.long))
        return self._layout[1]

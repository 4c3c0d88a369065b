"""Per-tensor range statistics streamed over bounded chunks: non-finite counts, abs-max, smallest
non-zero abs, and what a cast to FP16 or BF16 would do to the values (overflow, flush to zero).

The thresholds are those of a round-to-nearest-even cast, so the counts equal what
``t.to(torch.float16)`` / ``t.to(torch.bfloat16)`` does to a float32 tensor, boundaries included:

- FP16 overflow: ``|x| >= 65520`` becomes inf (65504 is the largest finite value; up to 65520 rounds down).
- FP16 flush: ``0 < |x| <= 2**-25`` (~2.98e-8, half the smallest subnormal 2**-24 ~ 5.96e-8) becomes 0.
- Values in FP16's subnormal range, ``2**-25 < |x| < 2**-14`` (~6.1e-5), survive with fewer than 11
  significant bits. They are *not* counted as flushed, and not counted at all: that would cost one
  more pass over every weight (about +20%); ``min_nonzero < 2**-14`` tells you that some exist.
- BF16 overflow: ``|x| >= (2 - 2**-8) * 2**127`` (~3.396e38); BF16 flush: ``0 < |x| <= 2**-134``.

NB: the work is done in numpy on float32 (float64 for float64 tensors) chunks of ``CHUNK`` elements,
so the passes after the first read hit cache; see ``bench/inspect_throughput.py``.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = [
    "CHUNK", "FP16_MAX", "FP16_OVERFLOW", "FP16_FLUSH", "BF16_OVERFLOW", "BF16_FLUSH",
    "TensorStats", "PairChange", "Workspace", "scan_tensor", "scan_pair",
]

FP16_MAX = 65504.0
FP16_OVERFLOW = 65520.0
FP16_FLUSH = 2.0**-25
BF16_OVERFLOW = (2 - 2.0**-8) * 2.0**127
BF16_FLUSH = 2.0**-134


class _Limits(NamedTuple):
    """The thresholds as scalars of the chunk's dtype: a Python float would make numpy compare slower."""

    zero: Any
    fp16_overflow: Any
    fp16_flush: Any
    bf16_overflow: Any
    bf16_flush: Any


_LIMITS = {t: _Limits(*(t(v) for v in (0.0, FP16_OVERFLOW, FP16_FLUSH, BF16_OVERFLOW, BF16_FLUSH)))
           for t in (np.float32, np.float64)}

CHUNK = 1 << 18  # elements (1 MiB of float32): passes after the first read cache; measured best of 8K..256K


@dataclass(frozen=True)
class TensorStats:
    """Counts over one floating-point tensor. abs_max and min_nonzero cover finite values only."""

    numel: int
    nan: int = 0
    inf: int = 0
    zeros: int = 0
    abs_max: float | None = None
    min_nonzero: float | None = None
    fp16_overflow: int = 0
    fp16_flush: int = 0
    bf16_overflow: int = 0
    bf16_flush: int = 0

    @property
    def nonfinite(self) -> int:
        return self.nan + self.inf

    def frac(self, count: int) -> float:
        return count / self.numel if self.numel else 0.0


@dataclass(frozen=True)
class PairChange:
    """How tensor B differs from tensor A of the same shape."""

    changed: int            # elements with a != b (NaN counts as changed)
    numel: int
    rel_change: float | None  # ||b - a|| / ||a|| (L2); None when ||a|| is 0 or either holds NaN/Inf

    @property
    def stalled(self) -> bool:
        return self.changed == 0


class _Acc:
    """Mutable running totals behind one TensorStats."""

    def __init__(self, numel: int):
        self.numel = numel
        self.nan = self.inf = self.zeros = 0
        self.fp16_overflow = self.fp16_flush = 0
        self.bf16_overflow = self.bf16_flush = 0
        self.abs_max = -1.0
        self.min_nonzero = math.inf
        self.nonneg = True  # until a chunk with a negative value (or NaN) shows up

    def freeze(self) -> TensorStats:
        return TensorStats(
            numel=self.numel, nan=self.nan, inf=self.inf, zeros=self.zeros,
            abs_max=None if self.abs_max < 0 else self.abs_max,
            min_nonzero=None if math.isinf(self.min_nonzero) else self.min_nonzero,
            fp16_overflow=self.fp16_overflow, fp16_flush=self.fp16_flush, bf16_overflow=self.bf16_overflow,
            bf16_flush=self.bf16_flush,
        )

    def update(self, x: np.ndarray, a: np.ndarray, m: np.ndarray) -> None:
        """Fold chunk `x` (read only) in. `a` (x's dtype) and `m` (bool) are scratch of at least x.size."""
        k = x.size
        a, m = a[:k], m[:k]
        lim = _LIMITS[x.dtype.type]
        lo = x.min() if self.nonneg else -1.0
        if lo >= 0:  # all >= 0 (NaN compares False): |x| is x, skip the abs pass
            src, hi = x, float(x.max())
        else:  # one signed chunk ends the shortcut for this tensor
            self.nonneg = False
            src = np.abs(x, out=a)
            lo, hi = src.min(), float(src.max())
        if not math.isfinite(hi):  # max propagates NaN: the rare path, allowed to allocate
            self.nan += int(np.count_nonzero(np.isnan(src, out=m)))
            self.inf += int(np.count_nonzero(np.isinf(src, out=m)))
            src = src[np.isfinite(src)]
            k = src.size
            if k == 0:
                return
            m = m[:k]
            lo, hi = src.min(), float(src.max())
        self.abs_max = max(self.abs_max, hi)
        if hi >= lim.fp16_overflow:
            self.fp16_overflow += int(np.count_nonzero(np.greater_equal(src, lim.fp16_overflow, out=m)))
            if hi >= lim.bf16_overflow:
                self.bf16_overflow += int(np.count_nonzero(np.greater_equal(src, lim.bf16_overflow, out=m)))
        zeros = 0
        if lo == 0:
            zeros = int(np.count_nonzero(np.equal(src, lim.zero, out=m)))
            self.zeros += zeros
            if zeros == k:
                return
            if src is x:  # never write to x: it may be the mmap'd file
                np.copyto(a, x)
                src = a
            np.copyto(src, np.inf, where=m)  # zeros must not count as small values below
            lo = src.min()
        self.min_nonzero = min(self.min_nonzero, float(lo))
        if hi <= lim.bf16_flush:  # every non-zero value flushes in both: no pass needed
            self.fp16_flush += k - zeros
            self.bf16_flush += k - zeros
        elif hi <= lim.fp16_flush:  # every non-zero value flushes in FP16 (tiny Adam second moments)
            self.fp16_flush += k - zeros
            if lo <= lim.bf16_flush:
                self.bf16_flush += int(np.count_nonzero(np.less_equal(src, lim.bf16_flush, out=m)))
        elif lo <= lim.fp16_flush:
            self.fp16_flush += int(np.count_nonzero(np.less_equal(src, lim.fp16_flush, out=m)))
            if lo <= lim.bf16_flush:
                self.bf16_flush += int(np.count_nonzero(np.less_equal(src, lim.bf16_flush, out=m)))


class Workspace:
    """Scratch buffers reused across tensors, so a scan allocates O(CHUNK), never O(tensor)."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self._bufs: dict[tuple[str, np.dtype], np.ndarray] = {}

    def buf(self, role: str, dtype) -> np.ndarray:
        key = (role, np.dtype(dtype))
        if key not in self._bufs:
            self._bufs[key] = np.empty(self.chunk, dtype=dtype)
        return self._bufs[key]


_TORCH_OF = {np.float32: torch.float32, np.float64: torch.float64}


def _np_dtype(*tensors: torch.Tensor):
    return np.float64 if any(t.dtype == torch.float64 for t in tensors) else np.float32


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of t's elements in memory order; order does not matter to these statistics."""
    if t.is_contiguous():
        return t.reshape(-1)
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return t.contiguous().reshape(-1)  # NB: copies; only overlapping or gappy views get here
        expected *= sz
    return t.as_strided((t.numel(),), (1,))


def _chunks(t: torch.Tensor, ws: Workspace, side: str, dtype) -> "iter[np.ndarray]":
    """Yield t's elements as numpy chunks of `dtype`: views when t already has it, else converted copies."""
    flat = _flat(t.detach())
    n, step = flat.numel(), ws.chunk
    if flat.dtype == _TORCH_OF[dtype]:
        view = flat.numpy()
        for i in range(0, n, step):
            yield view[i:i + step]
        return
    conv = ws.buf(f"conv-{side}", dtype)
    conv_t = torch.from_numpy(conv)
    for i in range(0, n, step):
        k = min(step, n - i)
        conv_t[:k].copy_(flat[i:i + k])
        yield conv[:k]


def scan_tensor(t: torch.Tensor, ws: Workspace, on_bytes: Callable[[int], None] | None = None) -> TensorStats:
    """Statistics of one floating-point tensor, streamed in chunks of ``ws.chunk`` elements.

    Example:
        >>> s = scan_tensor(torch.tensor([0.0, 1e-9, 7e4, float("nan")]), Workspace())
        >>> (s.nan, s.zeros, s.fp16_flush, s.fp16_overflow, s.abs_max)
        (1, 1, 1, 1, 70000.0)
    """
    dtype = _np_dtype(t)
    acc, a, m = _Acc(t.numel()), ws.buf("abs", dtype), ws.buf("mask", np.bool_)
    item = t.element_size()
    with np.errstate(all="ignore"):
        for x in _chunks(t, ws, "a", dtype):
            acc.update(x, a, m)
            if on_bytes is not None:
                on_bytes(x.size * item)
    return acc.freeze()


def scan_pair(ta: torch.Tensor, tb: torch.Tensor, ws: Workspace,
              on_bytes: Callable[[int], None] | None = None) -> tuple[TensorStats, TensorStats, PairChange]:
    """Statistics of A and B (same shape) and how B differs from A, reading each chunk once."""
    if ta.shape != tb.shape:
        raise ValueError(f"shapes differ: {tuple(ta.shape)} vs {tuple(tb.shape)}")
    dtype = _np_dtype(ta, tb)
    acc_a, acc_b = _Acc(ta.numel()), _Acc(tb.numel())
    a, m, d = ws.buf("abs", dtype), ws.buf("mask", np.bool_), ws.buf("diff", dtype)
    changed, dd, aa = 0, 0.0, 0.0
    item = ta.element_size() + tb.element_size()
    with np.errstate(all="ignore"):  # inf - inf and overflowing squares are expected, not warnings
        for xa, xb in zip(_chunks(ta, ws, "a", dtype), _chunks(tb, ws, "b", dtype)):
            k = xa.size
            changed += int(np.count_nonzero(np.not_equal(xa, xb, out=m[:k])))
            np.subtract(xb, xa, out=d[:k])
            dd += float(np.dot(d[:k], d[:k]))
            aa += float(np.dot(xa, xa))
            acc_a.update(xa, a, m)
            acc_b.update(xb, a, m)
            if on_bytes is not None:
                on_bytes(k * item)
    sa, sb = acc_a.freeze(), acc_b.freeze()
    ok = sa.nonfinite == 0 and sb.nonfinite == 0 and aa > 0 and math.isfinite(dd) and math.isfinite(aa)
    rel = math.sqrt(dd) / math.sqrt(aa) if ok else None
    return sa, sb, PairChange(changed=changed, numel=ta.numel(), rel_change=rel)

"""One tensor's range statistics, accumulated part by part: non-finite counts, abs-max, smallest non-zero
abs, and what a cast to FP16 or BF16 would do to the values (overflow, flush to zero).

The thresholds are those of a round-to-nearest-even cast, so the counts equal what
``t.to(torch.float16)`` / ``t.to(torch.bfloat16)`` does to a float32 tensor, boundaries included:

- FP16 overflow: ``|x| >= 65520`` becomes inf (65504 is the largest finite value; up to 65520 rounds down).
- FP16 flush: ``0 < |x| <= 2**-25`` (~2.98e-8, half the smallest subnormal 2**-24 ~ 5.96e-8) becomes 0.
- Values in FP16's subnormal range, ``2**-25 < |x| < 2**-14`` (~6.1e-5), survive with fewer than 11
  significant bits. They are *not* counted as flushed, and not counted at all: that would cost one
  more pass over every weight (about +20%); ``min_nonzero < 2**-14`` tells you that some exist.
- BF16 overflow: ``|x| >= (2 - 2**-8) * 2**127`` (~3.396e38); BF16 flush: ``0 < |x| <= 2**-134``.

How, with the compiled kernel (``analyzer/_scan.c``, built at install; ``compiled()``): float32 data
is read once, in blocks of 8192 elements, as bit patterns with the sign cleared, whose integer order is the
order of the magnitudes (inf and NaN above every finite value). One pass takes each block's greatest
magnitude and least magnitude minus 1 (a zero shows as -1), over 32 independent lanes; only a block whose
extremes cross a threshold is counted again while it is in L1, and a block after one with FP16 flushes
counts them in the extremes pass itself. bfloat16 and float16 data are read natively, as 16-bit
magnitudes (``scan_bf16``, ``scan_f16`` in ``_scan.c``). It runs at about the speed of a plain sum
(``bench/inspect_throughput.py``) and releases the GIL.

Without it (no C compiler at install, or ``Workspace(kernel="numpy")``), the same numbers come from numpy:
float32 chunks (bf16/fp16 converted, exactly) are read as their int32 and uint32 bit patterns.
int32 order holds the negatives by magnitude, then the positives by magnitude; uint32 order the
positives, then the negatives. The min and max in both orders (four integer reductions, no writes;
two for a chunk with no sign bit set) are the least and greatest magnitude of either sign, and since
inf and NaN have the greatest magnitudes they also say whether anything is non-finite. A healthy
chunk (abs-max < 65520, least magnitude > 2**-25) ends there. Only a chunk whose extremes cross a
threshold pays for counting passes, and one with NaN/Inf or an FP16 overflow takes the float path,
as float64 always does (float64 never uses the kernel). The chunks are small enough (``CHUNK`` in
``_tensorstats``) that the passes after the first read hit the core's L2 cache.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

try:
    from . import _scan  # compiled from _scan.c at install time; optional
except ImportError:  # installed without a C compiler: numpy gives the same numbers, slower
    _scan = None

__all__ = ["FP16_MAX", "FP16_OVERFLOW", "FP16_FLUSH", "BF16_OVERFLOW", "BF16_FLUSH", "TensorStats", "compiled"]

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


def compiled() -> bool:
    """Whether analyzer._scan (the compiled float32 scan) was built at install time."""
    return _scan is not None


def scan_pair_into(acc_a: _Acc, acc_b: _Acc, xa: np.ndarray, xb: np.ndarray) -> tuple[int, float, float]:
    """Fold float32 arrays xa and xb into their accumulators and return (elements that differ,
    sum((xb - xa)**2), sum(xa**2)), the sums in float64, all in one compiled read of each block."""
    ra, rb, changed, dd, aa = _scan.scan_pair_f32(xa, xb, *_KERNEL_LIMITS)
    acc_a.add_result(ra)
    acc_b.add_result(rb)
    return changed, dd, aa


def _bits(v: float) -> int:
    """The float32 bit pattern of v (v must be exactly representable)."""
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


_SIGN = 1 << 31
_MAG = np.uint32(_SIGN - 1)   # clears the sign bit
_B_OVERFLOW = _bits(FP16_OVERFLOW)  # NB: below inf (0x7F800000) and NaN, so one compare sends all three away
_B_FP16_FLUSH = _bits(FP16_FLUSH)
_B_BF16_FLUSH = _bits(BF16_FLUSH)
_KERNEL_LIMITS = (_B_OVERFLOW, _B_FP16_FLUSH, _bits(BF16_OVERFLOW), _B_BF16_FLUSH)


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


class _Acc:
    """Mutable running totals behind one TensorStats."""

    def __init__(self, numel: int, kernel: bool = False):
        self.numel = numel
        self.kernel = kernel  # float32 chunks go to the compiled scan
        self.nan = self.inf = self.zeros = 0
        self.fp16_overflow = self.fp16_flush = 0
        self.bf16_overflow = self.bf16_flush = 0
        self.abs_max = -1.0
        self.min_nonzero = math.inf
        self.hi_bits, self.lo_bits = -1, _SIGN  # the same two, as float32 bits, kept by update32
        self.counting = False  # update32: the last chunk was signed and had values to count
        self.nonneg = True  # until a chunk with a negative value (or NaN) shows up

    def merge(self, other: _Acc) -> None:
        """Fold in the totals of another part of the same tensor."""
        for f in ("nan", "inf", "zeros", "fp16_overflow", "fp16_flush", "bf16_overflow", "bf16_flush"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.abs_max = max(self.abs_max, other.abs_max)
        self.min_nonzero = min(self.min_nonzero, other.min_nonzero)
        self.hi_bits, self.lo_bits = max(self.hi_bits, other.hi_bits), min(self.lo_bits, other.lo_bits)

    def freeze(self) -> TensorStats:
        abs_max = max(self.abs_max, _f32(self.hi_bits) if self.hi_bits >= 0 else -1.0)
        min_nonzero = min(self.min_nonzero, _f32(self.lo_bits) if self.lo_bits < _SIGN else math.inf)
        return TensorStats(
            numel=self.numel, nan=self.nan, inf=self.inf, zeros=self.zeros,
            abs_max=None if abs_max < 0 else abs_max,
            min_nonzero=None if math.isinf(min_nonzero) else min_nonzero,
            fp16_overflow=self.fp16_overflow, fp16_flush=self.fp16_flush, bf16_overflow=self.bf16_overflow,
            bf16_flush=self.bf16_flush,
        )

    def add_scanned(self, x: np.ndarray, kind: str = "f32") -> None:
        """Fold in data `x` (any length) through the compiled kernel: one call, one read. `kind` "f32":
        float32 data; "bf16" / "f16": bfloat16 / float16 bit patterns (an int16 view), scanned as the
        float32 values they convert to exactly."""
        scan = {"f32": _scan.scan_f32, "bf16": _scan.scan_bf16, "f16": _scan.scan_f16}[kind]
        self.add_result(scan(x, *_KERNEL_LIMITS))

    def add_result(self, result: tuple[int, ...]) -> None:
        """Fold in the 9-tuple a kernel scan returned (see _scan.c)."""
        hi, lo, nan, inf, zeros, o16, f16, obf, fbf = result
        self.hi_bits = max(self.hi_bits, hi)
        if lo >= 0:
            self.lo_bits = min(self.lo_bits, lo)
        self.nan, self.inf, self.zeros = self.nan + nan, self.inf + inf, self.zeros + zeros
        self.fp16_overflow, self.fp16_flush = self.fp16_overflow + o16, self.fp16_flush + f16
        self.bf16_overflow, self.bf16_flush = self.bf16_overflow + obf, self.bf16_flush + fbf

    def fold(self, x: np.ndarray, a: np.ndarray, m: np.ndarray) -> None:
        """Fold chunk `x` (read only) in. `a` (x's dtype) and `m` (bool) are scratch of at least x.size."""
        if self.kernel and x.dtype == np.float32:
            self.add_scanned(x)
        elif x.dtype == np.float32:
            self.update32(x, a, m)
        else:
            self.update(x, a, m)

    def update32(self, x: np.ndarray, a: np.ndarray, m: np.ndarray) -> None:
        """The float32 path: decide from the extremes of the bit patterns (module docstring)."""
        k = x.size
        ints, bits, mag = x.view(np.int32), x.view(np.uint32), a[:k].view(np.uint32)
        if self.counting:  # the last chunk needed counting: so will this one, most likely; `&` first
            src = np.bitwise_and(bits, _MAG, out=mag)
            lo, hi = int(src.min()), int(src.max())
        else:
            lo = int(ints.min())  # NB: the one pass that reads memory; the rest hit cache
            if lo >= 0:  # no sign bit set: the bits are the magnitudes, in order (Adam's second moments)
                src, hi = bits, int(ints.max())
            else:
                # int32 order: negatives by magnitude, then positives by magnitude; uint32: positives,
                # then negatives. Their four extremes are the least and greatest magnitude of either sign.
                src = None
                hi = max(int(ints.max()), int(bits.max()) - _SIGN)
                lo = min(int(bits.min()), lo + _SIGN)
        if hi >= _B_OVERFLOW:  # NaN, inf or an FP16 overflow: rare, counted by the float path
            self.update(x, a, m)
            return
        self.hi_bits = max(self.hi_bits, hi)
        self.counting = src is not bits and lo <= _B_FP16_FLUSH < hi
        if lo > _B_FP16_FLUSH:  # the common case: no zero, nothing flushes, nothing more to count
            self.lo_bits = min(self.lo_bits, lo)
            return
        if src is None:
            src = np.bitwise_and(bits, _MAG, out=mag)
        zeros, shift = 0, 0
        if lo == 0:
            zeros = int(np.count_nonzero(np.equal(src.view(np.float32), np.float32(0), out=m[:k])))
            self.zeros += zeros
            if zeros == k:
                return
            # zeros wrap to 2**32 - 1, above every threshold; the thresholds shift down by one with the rest
            src, shift = np.subtract(src, np.uint32(1), out=mag), 1
            lo = int(src.min()) + 1
        self.lo_bits = min(self.lo_bits, lo)
        nonzero = k - zeros
        for field, limit in (("fp16_flush", _B_FP16_FLUSH), ("bf16_flush", _B_BF16_FLUSH)):
            if lo > limit:
                continue
            if hi <= limit:  # every non-zero value flushes (tiny Adam second moments): no pass needed
                n = nonzero
            else:  # compared as float32 (twice as fast as uint32; same order here, shifted zeros are NaN)
                n = int(np.count_nonzero(np.less_equal(src.view(np.float32), np.float32(_f32(limit - shift)),
                                                       out=m[:k])))
            setattr(self, field, getattr(self, field) + n)

    def update(self, x: np.ndarray, a: np.ndarray, m: np.ndarray) -> None:
        """The float path, with float comparisons: float64 chunks, and float32 ones with NaN/Inf or overflow."""
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

"""What the scan reports about one tensor (``TensorStats``) or a pair (``PairChange``), and the cast
thresholds it counts against, as bit patterns of each dtype.

The thresholds are those of a round-to-nearest-even cast, so the counts equal what
``t.to(torch.float16)`` / ``t.to(torch.bfloat16)`` does to the values, boundaries included:

- FP16 overflow: ``|x| >= 65520`` becomes inf (65504 is the largest finite value; up to 65520 rounds down).
- FP16 flush: ``0 < |x| <= 2**-25`` (~2.98e-8, half the smallest subnormal 2**-24) becomes 0.
- Values in FP16's subnormal range, ``2**-25 < |x| < 2**-14`` (~6.1e-5), survive with fewer than 11
  significant bits. They are not counted: ``min_nonzero < 2**-14`` says that some exist.
- BF16 overflow: ``|x| >= (2 - 2**-8) * 2**127`` (~3.396e38); BF16 flush: ``0 < |x| <= 2**-134``.

NB: with the sign bit cleared, the bit patterns of an IEEE float sort like the magnitudes, with inf and
NaN above every finite value. So every threshold is one integer per dtype (``BITS``), and the scan
compares integers, which is exact whatever the CPU's SIMD width.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

__all__ = ["FP16_MAX", "FP16_OVERFLOW", "FP16_FLUSH", "BF16_OVERFLOW", "BF16_FLUSH", "TensorStats",
           "PairChange", "Bits", "BITS"]


def _overflow_at(dtype: torch.dtype) -> float:
    """The smallest magnitude that rounds to inf: the largest finite value plus half its spacing."""
    fi = torch.finfo(dtype)
    return fi.max + 2.0 ** (math.frexp(fi.max)[1] - 1) * fi.eps / 2


def _flush_below(dtype: torch.dtype) -> float:
    """Magnitudes at or below this round to zero: half the smallest subnormal."""
    fi = torch.finfo(dtype)
    return fi.smallest_normal * fi.eps / 2


FP16_MAX = float(torch.finfo(torch.float16).max)
FP16_OVERFLOW = _overflow_at(torch.float16)   # 65520
FP16_FLUSH = _flush_below(torch.float16)      # 2**-25
BF16_OVERFLOW = _overflow_at(torch.bfloat16)  # (2 - 2**-8) * 2**127
BF16_FLUSH = _flush_below(torch.bfloat16)     # 2**-134


@dataclass(frozen=True)
class TensorStats:
    """Counts over one floating-point tensor's elements. abs_max and min_nonzero cover finite values only.

    For a view whose elements overlap in memory (an ``expand``ed tensor, stride 0), the counts are over
    its distinct elements, and ``numel`` says how many those are.
    """

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
    """How tensor B differs from tensor A of the same shape.

    ``rel_change`` is ``sqrt(sum((b - a)**2)) / sqrt(sum(a**2))`` with both sums in float64 (the values
    converted exactly, the sums in a fixed order, so the result does not depend on the CPU).
    """

    changed: int            # elements with a != b (NaN counts as changed)
    numel: int
    rel_change: float | None  # None when ||a|| is 0 or either side holds NaN/Inf

    @property
    def stalled(self) -> bool:
        return self.changed == 0


@dataclass(frozen=True)
class Bits:
    """One dtype's magnitude bit patterns as integers of ``view`` (the same width), and its thresholds.

    ``inf`` is the first non-finite magnitude (inf, or NaN for float8_e4m3fn, which has no inf).
    ``*_over`` is the least magnitude that overflows (``inf`` when none can); ``*_flush`` the greatest
    that flushes to zero (0 when none can: then only zeros are <= it).
    """

    view: torch.dtype
    mask: int
    inf: int
    has_inf: bool
    fp16_over: int
    bf16_over: int
    fp16_flush: int
    bf16_flush: int

    def value(self, bits: int, dtype: torch.dtype) -> float:
        """The magnitude whose bit pattern is `bits`, as a Python float (exact)."""
        return torch.tensor([bits], dtype=self.view).view(dtype).item()


def _ieee(view: torch.dtype, fmt: str, ufmt: str, mask: int) -> Bits:
    def bits(v: float) -> int:
        return struct.unpack(ufmt, struct.pack(fmt, v))[0]

    return Bits(view, mask, bits(math.inf), True, bits(FP16_OVERFLOW), bits(BF16_OVERFLOW),
                bits(FP16_FLUSH), bits(BF16_FLUSH))


def _small(dtype: torch.dtype, view: torch.dtype, width: int) -> Bits:
    """Thresholds of a 16- or 8-bit float, read off all its magnitudes (exact, no rounding argument)."""
    mask = (1 << (width - 1)) - 1
    vals = torch.arange(0, mask + 1, dtype=torch.int32).to(view).view(dtype).double().tolist()
    first_bad = next(i for i, v in enumerate(vals) if not math.isfinite(v))
    finite = vals[:first_bad]
    return Bits(
        view, mask, first_bad, vals[first_bad] == math.inf,
        fp16_over=sum(v < FP16_OVERFLOW for v in finite), bf16_over=sum(v < BF16_OVERFLOW for v in finite),
        fp16_flush=max(0, sum(v <= FP16_FLUSH for v in finite) - 1),
        bf16_flush=max(0, sum(v <= BF16_FLUSH for v in finite) - 1))


BITS: dict[torch.dtype, Bits] = {
    torch.float32: _ieee(torch.int32, "<f", "<I", 0x7FFFFFFF),
    torch.float64: _ieee(torch.int64, "<d", "<Q", 0x7FFFFFFFFFFFFFFF),
    torch.bfloat16: _small(torch.bfloat16, torch.int16, 16),
    torch.float16: _small(torch.float16, torch.int16, 16),
    torch.float8_e4m3fn: _small(torch.float8_e4m3fn, torch.int8, 8),
    torch.float8_e5m2: _small(torch.float8_e5m2, torch.int8, 8),
}

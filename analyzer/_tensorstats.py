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

How: float32 chunks (bf16/fp16 converted, exactly) are read as their int32 and uint32 bit patterns.
int32 order holds the negatives by magnitude, then the positives by magnitude; uint32 order the
positives, then the negatives. The min and max in both orders (four integer reductions, no writes;
two for a chunk with no sign bit set) are the least and greatest magnitude of either sign, and since
inf and NaN have the greatest magnitudes they also say whether anything is non-finite. A healthy
chunk (abs-max < 65520, least magnitude > 2**-25) ends there. Only a chunk whose extremes cross a
threshold pays for counting passes, and one with NaN/Inf or an FP16 overflow takes the float path,
as float64 always does.

NB: the work is done in numpy on chunks of ``CHUNK`` elements, so the passes after the first read hit
the core's L2 cache. A large tensor is split between ``Workspace.threads`` threads (numpy releases the
GIL); see ``bench/inspect_throughput.py`` for what each choice measured.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = [
    "CHUNK", "THREAD_CHUNK", "FP16_MAX", "FP16_OVERFLOW", "FP16_FLUSH", "BF16_OVERFLOW", "BF16_FLUSH",
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

CHUNK = 1 << 17  # elements (512 KiB of float32): chunk + scratch fit a 1 MiB L2; measured best of 64K..1M
THREAD_CHUNK = 1 << 19  # with threads: shorter numpy calls lose more to GIL hand-offs than cache gives back


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

    def fold(self, x: np.ndarray, a: np.ndarray, m: np.ndarray) -> None:
        """Fold chunk `x` (read only) in. `a` (x's dtype) and `m` (bool) are scratch of at least x.size."""
        if x.dtype == np.float32:
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


class Workspace:
    """Scratch buffers reused across tensors, so a scan allocates O(CHUNK) per thread, never O(tensor).

    A tensor of at least ``16 * part_chunk`` elements is split into up to ``threads`` contiguous parts
    of at least 8 chunks of ``part_chunk``, scanned at once (numpy releases the GIL); others are
    scanned on this thread in chunks of ``chunk``. ``threads`` defaults to ``torch.get_num_threads()``, so
    ``torch.set_num_threads(1)`` (or ``OMP_NUM_THREADS=1``) keeps the scan on one core. ``chunk``
    defaults to ``CHUNK``, ``part_chunk`` to ``THREAD_CHUNK`` (or ``chunk`` when given); both were
    measured with ``bench/inspect_throughput.py``.

    Example:
        >>> with Workspace() as ws:
        ...     s = scan_tensor(torch.ones(10), ws)
    """

    def __init__(self, chunk: int | None = None, threads: int | None = None):
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.threads = max(1, torch.get_num_threads() if threads is None else threads)
        self.chunk = chunk or CHUNK
        self.part_chunk = chunk or THREAD_CHUNK
        self._bufs: dict[tuple[str, int, np.dtype], np.ndarray] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._torch_threads: int | None = None

    def buf(self, role: str, dtype, slot: int = 0) -> np.ndarray:
        key = (role, slot, np.dtype(dtype))
        if key not in self._bufs:
            self._bufs[key] = np.empty(max(self.chunk, self.part_chunk), dtype=dtype)
        return self._bufs[key]

    def parts(self, n: int) -> list[tuple[int, int]]:
        """[start, stop) ranges, chunk-aligned, one per thread that gets work."""
        k = min(self.threads, n // (8 * self.part_chunk)) or 1  # a part under 8 chunks: no gain measured
        per = -(-n // k // self.part_chunk) * self.part_chunk
        return [(i, min(i + per, n)) for i in range(0, n, per)] if n else [(0, 0)]

    def run(self, fns: list[Callable[[], Any]]) -> list[Any]:
        """Call fns at once, the first on this thread; return their results in order."""
        if len(fns) == 1:
            return [fns[0]()]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="amp-autopsy-scan")
        futures = [self._pool.submit(f) for f in fns[1:]]
        first = fns[0]()
        return [first] + [f.result() for f in futures]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self) -> Workspace:
        # NB: torch's own threads off while ours run (bf16/fp16 chunks convert with torch): 2 x 2 threads on
        # 2 cores spin against each other. Restored on exit.
        self._torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self._torch_threads is not None:
            torch.set_num_threads(self._torch_threads)
            self._torch_threads = None


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


def _chunks(flat: torch.Tensor, ws: Workspace, side: str, dtype, slot: int = 0,
            step: int | None = None) -> Iterator[np.ndarray]:
    """Yield flat's elements as numpy chunks of `dtype`: views when flat already has it, else converted copies."""
    n, step = flat.numel(), step or ws.chunk
    if flat.dtype == _TORCH_OF[dtype]:
        view = flat.numpy()
        for i in range(0, n, step):
            yield view[i:i + step]
        return
    conv = ws.buf(f"conv-{side}", dtype, slot)
    conv_t = torch.from_numpy(conv)
    for i in range(0, n, step):
        k = min(step, n - i)
        conv_t[:k].copy_(flat[i:i + k])
        yield conv[:k]


def _scan_part(flat: torch.Tensor, ws: Workspace, slot: int, dtype, step: int,
               on_bytes: Callable[[int], None] | None) -> _Acc:
    acc, a, m = _Acc(flat.numel()), ws.buf("abs", dtype, slot), ws.buf("mask", np.bool_, slot)
    item = flat.element_size()
    with np.errstate(all="ignore"):
        for x in _chunks(flat, ws, "a", dtype, slot, step):
            acc.fold(x, a, m)
            if on_bytes is not None:
                on_bytes(x.size * item)
    return acc


def scan_tensor(t: torch.Tensor, ws: Workspace, on_bytes: Callable[[int], None] | None = None) -> TensorStats:
    """Statistics of one floating-point tensor, streamed in chunks of ``ws.chunk`` elements.

    Example:
        >>> s = scan_tensor(torch.tensor([0.0, 1e-9, 7e4, float("nan")]), Workspace())
        >>> (s.nan, s.zeros, s.fp16_flush, s.fp16_overflow, s.abs_max)
        (1, 1, 1, 1, 70000.0)
    """
    dtype, flat = _np_dtype(t), _flat(t.detach())
    parts = ws.parts(flat.numel())
    if len(parts) == 1:
        return _scan_part(flat, ws, 0, dtype, ws.chunk, on_bytes).freeze()
    # NB: progress is reported from this thread only: the other parts report when they finish
    fns = [lambda s=s, lo=lo, hi=hi: _scan_part(flat[lo:hi], ws, s, dtype, ws.part_chunk,
                                                on_bytes if s == 0 else None)
           for s, (lo, hi) in enumerate(parts)]
    accs = ws.run(fns)
    if on_bytes is not None:
        on_bytes(sum(a.numel for a in accs[1:]) * flat.element_size())
    total = _Acc(flat.numel())
    for acc in accs:
        total.merge(acc)
    return total.freeze()


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
        for xa, xb in zip(_chunks(_flat(ta.detach()), ws, "a", dtype), _chunks(_flat(tb.detach()), ws, "b", dtype)):
            k = xa.size
            changed += int(np.count_nonzero(np.not_equal(xa, xb, out=m[:k])))
            np.subtract(xb, xa, out=d[:k])
            dd += float(np.dot(d[:k], d[:k]))
            aa += float(np.dot(xa, xa))
            acc_a.fold(xa, a, m)
            acc_b.fold(xb, a, m)
            if on_bytes is not None:
                on_bytes(k * item)
    sa, sb = acc_a.freeze(), acc_b.freeze()
    ok = sa.nonfinite == 0 and sb.nonfinite == 0 and aa > 0 and math.isfinite(dd) and math.isfinite(aa)
    rel = math.sqrt(dd) / math.sqrt(aa) if ok else None
    return sa, sb, PairChange(changed=changed, numel=ta.numel(), rel_change=rel)

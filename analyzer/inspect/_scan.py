"""The one tensor scan behind ``analyzer inspect``: range statistics in torch ops, chunk by chunk.

How: each chunk's bit patterns, sign cleared into a reused buffer (``torch.abs`` for float32 and
float64 on the CPU, which measured faster; ``bitwise_and`` otherwise), go through one ``aminmax``.
With the sign cleared the integer order is the order of the magnitudes, inf and NaN above every
finite value (``_stats``), so the two extremes decide everything for a healthy chunk: abs-max below
FP16's overflow point and least magnitude above its flush point means no NaN, no inf, no zero and
nothing to count (nor does a chunk wholly below a flush point). Only a chunk whose extremes
cross a threshold is counted exactly, on the same buffer while it is in cache (``_count_le``: integer
clamps and wrapping sums, exact on any CPU). The scan never writes to the tensor (it may be the mmap'd
file).

bfloat16, float16, float32, float64 and float8 are read as their own bit patterns; other float dtypes
(float8 variants without a fixed layout here) are converted to float32 chunk by chunk, exactly.
The scan runs wherever ``device`` says: a CUDA device gets each chunk copied over
(``inspect --device cuda``). ``bench/inspect_throughput.py`` measures it against ``torch.load`` + a sum.
"""
from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ._change import PAIR_STEP, Change
from ._pieces import distinct, pair_pieces, pieces, scanned_numel
from ._stats import BITS, Bits, PairChange, TensorStats

__all__ = ["CHUNK", "CUDA_CHUNK", "Scanner", "scan_all", "scanned_numel"]

CHUNK = 1 << 18       # float32 elements per CPU chunk (1 MiB; other dtypes: as many bytes): best or within
                      # noise of best on a 2 MiB-L2 Xeon and a 1 MiB-L2 Zen 4 (bench: --chunk)
CUDA_CHUNK = 1 << 24  # per GPU chunk: large enough that each copy and kernel launch is cheap
# NB: for these, torch.abs clears the sign bit (NaNs' too, tested on every kernel) faster than bitwise_and
_ABS = (torch.float32, torch.float64)
SPLIT_AT = 1 << 24    # elements: a lone tensor this large is cut into one part per thread
_PEEK = 64            # a tensor's first chunk: a sign bit among this many first values skips the read-only try


class _Acc:
    """Running totals of one tensor, in bit patterns until ``freeze``."""

    def __init__(self, bits: Bits):
        self.b = bits
        self.numel = self.nan = self.inf = self.zeros = 0
        self.fp16_overflow = self.fp16_flush = self.bf16_overflow = self.bf16_flush = 0
        self.hi = -1                # greatest finite magnitude seen, as bits (-1: none)
        self.lo = bits.inf          # least non-zero finite magnitude seen, as bits (inf: none)
        self.nonneg = True          # no chunk had a sign bit set yet (Adam's second moments never do)
        self.n = 0                  # elements per chunk, set by Scanner._acc
        self.mag: torch.Tensor | None = None  # scratch of the scanner's chunk size, set by Scanner._acc
        self.tmp: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None  # bits.mask as a 0-d tensor on the scan's device, set by Scanner._acc
        self.abs = False            # clear sign bits with torch.abs (float32/float64 on the CPU: faster)

    def freeze(self, dtype: torch.dtype) -> TensorStats:
        b = self.b
        return TensorStats(
            numel=self.numel, nan=self.nan, inf=self.inf, zeros=self.zeros,
            abs_max=None if self.hi < 0 else b.value(self.hi, dtype),
            min_nonzero=None if self.lo >= b.inf else b.value(self.lo, dtype),
            fp16_overflow=self.fp16_overflow, fp16_flush=self.fp16_flush,
            bf16_overflow=self.bf16_overflow, bf16_flush=self.bf16_flush)


def _count_le(x: torch.Tensor, limit: int, out: torch.Tensor) -> int:
    """How many of x (magnitude bits, >= 0) are <= limit. `out` is scratch of x's size; it may be x itself
    when x is ours and no longer needed.

    NB: x is clamped to {limit, limit + 1} and summed in its own integer width, which wraps: a sum of n
    such values is n * limit + (how many are above), modulo 2**width, and that count comes back exactly
    while n < 2**(width - 1). So 32- and 64-bit chunks are summed whole, and 8- and 16-bit ones down
    columns short enough (a ragged tail of fewer than a row is compared). Two passes at the speed of a
    sum, on any SIMD width; a bool mask and its sum, or a sum into a wider type, cost several times that
    (measured)."""
    k = x.numel()
    if limit < 0:
        return 0
    if limit >= torch.iinfo(x.dtype).max:
        return k
    width = x.element_size() * 8
    y = torch.clamp(x, limit, limit + 1, out=out)
    if width >= 32:
        return k - (int(y.sum(dtype=y.dtype)) - k * limit) % (1 << width)
    cols = -(-k // ((1 << (width - 1)) - 1))  # 8/16-bit: each column sums at most 2**(width-1) - 1 values
    cols = -(-cols // 64) * 64                 # and a row is whole SIMD vectors
    rows = k // cols
    above = 0
    if rows:
        sums = y[:rows * cols].view(rows, cols).sum(0, dtype=y.dtype)
        above = int(sums.to(torch.int64).sub_(rows * limit).remainder_(1 << width).sum())
    if rows * cols < k:
        above += int((y[rows * cols:] > limit).sum())
    return k - above


def _healthy(acc: _Acc, k: int, lo: int, hi: int) -> bool:
    """Fold in a chunk of k values whose extremes (as magnitude bits) are lo and hi, if they alone give every
    count: no zero, nothing non-finite or past FP16's max, and each flush threshold above or below the
    whole chunk (Adam's second moments often lie wholly below FP16's)."""
    b = acc.b
    if lo <= 0 or hi >= b.fp16_over:
        return False
    f16 = 0 if lo > b.fp16_flush else k if hi <= b.fp16_flush else -1
    bf = 0 if lo > b.bf16_flush else k if hi <= b.bf16_flush else -1
    if f16 < 0 or bf < 0:
        return False
    acc.numel += k
    acc.fp16_flush += f16
    acc.bf16_flush += bf
    acc.hi, acc.lo = max(acc.hi, hi), min(acc.lo, lo)
    return True


def _fold(acc: _Acc, mag: torch.Tensor, tmp: torch.Tensor, lo: int, hi: int, own: bool) -> None:
    """Count one chunk of magnitude bit patterns whose extremes are lo and hi. `tmp` is scratch. `mag` is
    written to only when `own` (then the last count runs in place), or when it holds a zero or a
    non-finite value (the caller passes its own copy then)."""
    b, k = acc.b, mag.numel()
    acc.numel += k

    def le(limit: int, last: bool = False) -> int:
        return _count_le(mag, limit, mag if last and own else tmp)

    junk = 0  # non-finite values, set to 0 below so that they drop out of every other count
    if hi >= b.inf:
        junk = k - le(b.inf - 1)
        inf = le(b.inf) - (k - junk) if b.has_inf else 0
        acc.nan, acc.inf = acc.nan + junk - inf, acc.inf + inf
        mag.masked_fill_(mag >= b.inf, 0)
        hi = int(mag.max())
    if hi >= b.fp16_over:
        acc.fp16_overflow += k - le(b.fp16_over - 1)
        if hi >= b.bf16_over:
            acc.bf16_overflow += k - le(b.bf16_over - 1)
    zeros = le(0) if lo == 0 or junk else 0
    acc.zeros += zeros - junk
    if junk < k:
        acc.hi = max(acc.hi, hi)
    if zeros == k:
        return
    shift = 0
    if zeros:  # zeros wrap to the mask, above every threshold; every threshold shifts down by one
        mag.sub_(1).bitwise_and_(acc.mask)
        lo, shift = int(mag.min()) + 1, 1
    acc.lo = min(acc.lo, lo)
    bf16_pass = b.bf16_flush < hi and lo <= b.bf16_flush  # bf16_flush <= fp16_flush: counted second
    for field, limit in (("fp16_flush", b.fp16_flush), ("bf16_flush", b.bf16_flush)):
        if lo > limit:
            continue
        last = field == "bf16_flush" or not bf16_pass
        n = k - zeros if hi <= limit else le(limit - shift, last)  # all flush: no pass needed
        setattr(acc, field, getattr(acc, field) + n)


class Scanner:
    """Scratch buffers and a device for scanning many tensors, so a scan allocates O(chunk), not O(tensor).

    Args:
        device: where the comparisons run; ``"cuda"`` copies each chunk to the GPU.
        chunk: elements per chunk (default ``CHUNK`` on CPU, ``CUDA_CHUNK`` on a GPU).

    Example:
        >>> s = Scanner().tensor(torch.tensor([0.0, 1e-9, 7e4, float("nan")]))
        >>> (s.nan, s.zeros, s.fp16_flush, s.fp16_overflow, s.abs_max)
        (1, 1, 1, 1, 70000.0)
    """

    def __init__(self, device: str | torch.device = "cpu", chunk: int | None = None):
        self.device = torch.device(device)
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.chunk = chunk or (CHUNK if self.device.type == "cpu" else CUDA_CHUNK)
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._masks: dict[torch.dtype, torch.Tensor] = {}

    def _buf(self, role: str, dtype: torch.dtype, k: int) -> torch.Tensor:
        buf = self._bufs.get((role, dtype))
        if buf is None or buf.numel() < k:
            buf = self._bufs[(role, dtype)] = torch.empty(max(k, self.chunk), dtype=dtype, device=self.device)
        return buf[:k]

    def _n(self, *ts: torch.Tensor) -> int:
        """Elements per chunk for these tensors: ``chunk`` float32s' worth of bytes of the widest."""
        return max(1, self.chunk * 4 // max(t.element_size() for t in ts))

    def _acc(self, dtype: torch.dtype, n: int) -> _Acc:
        acc = _Acc(BITS[dtype])
        acc.n = n
        acc.mag, acc.tmp = self._buf("mag", acc.b.view, n), self._buf("tmp", acc.b.view, n)
        acc.mask = self._masks.get(acc.b.view)
        if acc.mask is None:  # NB: bitwise_and with a 0-d tensor runs ~20% faster than with a Python int
            acc.mask = self._masks[acc.b.view] = torch.tensor(acc.b.mask, dtype=acc.b.view, device=self.device)
        acc.abs = dtype in _ABS and self.device.type == "cpu"
        return acc

    def _fold(self, acc: _Acc, x: torch.Tensor, dtype: torch.dtype) -> None:
        """Fold a chunk of at most ``self.chunk`` elements in. NB: the hot loop; kept to a few calls."""
        if self.device.type != "cpu":
            x = x.to(self.device)
        if x.dtype != dtype:  # a float dtype without its own bit layout: converted exactly
            x = x.float()
        b, k = acc.b, x.numel()
        bits = x.view(b.view)
        full = k == acc.n
        tmp = acc.tmp if full else acc.tmp[:k]
        if acc.nonneg and acc.numel == 0 and k > _PEEK and int(bits[:_PEEK].min()) < 0:
            acc.nonneg = False  # a signed tensor shows it in its first values: skip the read-only try
        if acc.nonneg:  # no sign bit so far: the bits are the magnitudes, one read and no write
            lo, hi = torch.aminmax(bits)
            lo, hi = lo.item(), hi.item()  # NB: a host sync per chunk
            if lo >= 0:
                if not _healthy(acc, k, lo, hi):
                    if lo > 0 and hi < b.inf:  # counts only, nothing written: read where it lies
                        _fold(acc, bits, tmp, lo, hi, own=False)
                    else:
                        _fold(acc, acc.mag[:k].copy_(bits), tmp, lo, hi, own=True)
                return
            acc.nonneg = False
        mag = acc.mag if full else acc.mag[:k]
        if acc.abs:
            torch.abs(x, out=mag.view(dtype))
        else:
            torch.bitwise_and(bits, acc.mask, out=mag)
        lo, hi = torch.aminmax(mag)
        lo, hi = lo.item(), hi.item()  # NB: a host sync per chunk
        if not _healthy(acc, k, lo, hi):
            _fold(acc, mag, tmp, lo, hi, own=True)

    def tensor(self, t: torch.Tensor, on_bytes: Callable[[int], None] | None = None) -> TensorStats:
        """Statistics of one floating-point tensor (CPU or not; never copied whole, never written to)."""
        dtype = t.dtype if t.dtype in BITS else torch.float32
        if t.numel() == 0:  # nothing to read: no scratch, no views (a file may hold 100k of them)
            return _Acc(BITS[dtype]).freeze(dtype)
        n = self._n(t)
        acc = self._acc(dtype, n)
        for x in pieces(t.detach(), n):
            self._fold(acc, x, dtype)
            if on_bytes is not None:
                on_bytes(x.numel() * x.element_size())
        return acc.freeze(dtype)

    def pair(self, ta: torch.Tensor, tb: torch.Tensor, on_bytes: Callable[[int], None] | None = None,
             ) -> tuple[TensorStats, TensorStats, PairChange] | None:
        """Statistics of A and B (same shape) and how B differs, reading each chunk once; None when the
        two cannot be paired element by element without materialising a view (differently expanded)."""
        if ta.shape != tb.shape:
            raise ValueError(f"shapes differ: {tuple(ta.shape)} vs {tuple(tb.shape)}")
        n = self._n(ta, tb)
        it = pair_pieces(ta.detach(), tb.detach(), n)
        if it is None:
            return None
        da = ta.dtype if ta.dtype in BITS else torch.float32
        db = tb.dtype if tb.dtype in BITS else torch.float32
        acc_a, acc_b = self._acc(da, n), self._acc(db, n)
        # NB: the float64 work runs in steps of PAIR_STEP on the CPU, so its three rows stay in L2
        diff = Change(min(n, PAIR_STEP) if self.device.type == "cpu" else n, torch.float64 not in (da, db),
                      lambda k: self._buf("pair", torch.float64, k))
        def nonfinite() -> int:
            return acc_a.nan + acc_a.inf + acc_b.nan + acc_b.inf

        for xa, xb in it:
            if self.device.type != "cpu":
                xa, xb = xa.to(self.device), xb.to(self.device)
            before = nonfinite()
            self._fold(acc_a, xa, da)
            self._fold(acc_b, xb, db)
            diff.add(xa, xb, finite=nonfinite() == before)  # this chunk pair is finite: count by clamping
            if on_bytes is not None:
                on_bytes(xa.numel() * xa.element_size() + xb.numel() * xb.element_size())
        sa, sb = acc_a.freeze(da), acc_b.freeze(db)
        aa_s, dd_s, changed = diff.result()
        ok = sa.nonfinite == 0 and sb.nonfinite == 0 and aa_s > 0 and math.isfinite(dd_s) and math.isfinite(aa_s)
        rel = math.sqrt(dd_s) / math.sqrt(aa_s) if ok else None
        return sa, sb, PairChange(changed=changed, numel=sa.numel, rel_change=rel)


Result = tuple[TensorStats, "TensorStats | None", "PairChange | None"]


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to n inside, restored after.

    NB: the scan runs ~10 small ops per chunk; each is an OpenMP region when torch has 2+ threads, and on
    a busy machine every region waits for a descheduled thread (measured: 100x slower on 2 loaded cores).
    So the scan's threads are ours, one tensor each, and torch's are 1 meanwhile (process-wide).
    """
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def scan_all(items: Sequence[tuple[torch.Tensor, torch.Tensor | None]], device: str = "cpu",
             on_bytes: Callable[[int], None] | None = None, threads: int | None = None,
             wait: Callable[[int], None] | None = None) -> list[Result]:
    """For each (A, None): (A's stats, None, None); for each (A, B): A's and B's stats and the change
    (None when the two cannot be paired). On the CPU, items run side by side on ``threads`` threads
    (default ``torch.get_num_threads()``), each scanning whole tensors; the results do not depend on it.
    `wait(i)` is called before item i (or a part of it) is read: a file's reader catching up.

    Example:
        >>> [r[0].abs_max for r in scan_all([(torch.ones(3), None), (torch.full((2,), -4.0), None)])]
        [1.0, 4.0]
    """
    threads = threads or torch.get_num_threads()
    if torch.device(device).type != "cpu" or any(b is not None for _, b in items):
        # NB: a pair's float64 steps are many small ops, and on two threads each op waited for the GIL:
        # 0.85x the speed of one thread (measured), so pairs run on one
        threads = 1
    lock = threading.Lock()

    def report(n: int) -> None:
        with lock:
            on_bytes(n)

    local = threading.local()

    def one(item: tuple[torch.Tensor, torch.Tensor | None], i: int) -> Result:
        if wait is not None:
            wait(i)
        scanner = getattr(local, "scanner", None)
        if scanner is None:
            scanner = local.scanner = Scanner(device)
        cb = report if on_bytes is not None else None
        a, b = item
        if b is None:
            return scanner.tensor(a, cb), None, None
        return scanner.pair(a, b, cb) or (scanner.tensor(a, cb), scanner.tensor(b, cb), None)

    if threads <= 1:  # NB: torch's threads too: ops of a pair's step size paid for OpenMP regions (1.2x)
        with _torch_threads(1) if torch.device(device).type == "cpu" else contextlib.nullcontext():
            return [one(item, i) for i, item in enumerate(items)]
    # a large lone tensor is cut into `threads` parts of its flat view, so one embedding does not leave
    # the other threads idle; its parts' statistics are merged back (exact: counts add, extremes compare)
    work, owner = [], []
    for i, (a, b) in enumerate(items):
        parts = _parts(a, threads) if b is None else [a]
        work += [(p, b, i) for p in parts]
        owner += [i] * len(parts)
    # NB: one task per batch of small tensors, not per tensor: 100k empty tensors made 100k futures
    # (~2 KiB each, and a lock round trip), so memory and time grew with the count, not the bytes
    batches = _batches(work, threads)
    with _torch_threads(1), ThreadPoolExecutor(threads, thread_name_prefix="amp-autopsy-scan") as pool:
        done = [r for batch in pool.map(lambda batch: [one((a, b), i) for a, b, i in batch], batches) for r in batch]
    out: list[list[Result]] = [[] for _ in items]
    for i, r in zip(owner, done):
        out[i].append(r)
    return [rs[0] if len(rs) == 1 else (_merge([r[0] for r in rs]), None, None) for rs in out]


def _batches(work: list, threads: int, most: int = 512) -> list[list]:
    """`work` cut, in order, into runs of at most `most` items holding about 1/(4 x threads) of its bytes each."""
    def nbytes(t: torch.Tensor | None) -> int:
        return 0 if t is None or t.numel() == 0 else distinct(t).numel() * t.element_size()

    sizes = [nbytes(item[0]) + nbytes(item[1]) for item in work]
    target = max(1, sum(sizes) // (4 * threads))
    out, cur, held = [], [], 0
    for item, size in zip(work, sizes):
        cur.append(item)
        held += size
        if held >= target or len(cur) >= most:
            out.append(cur)
            cur, held = [], 0
    return out + ([cur] if cur else [])


def _parts(t: torch.Tensor, threads: int) -> list[torch.Tensor]:
    """t's distinct elements as `threads` 1-D views when t is dense and at least SPLIT_AT elements, else [t]."""
    if t.numel() < SPLIT_AT:
        return [t]
    d = distinct(t)
    if d.numel() < SPLIT_AT or not d.is_contiguous():
        return [t]
    flat = d.view(-1)
    per = -(-flat.numel() // threads)
    return [flat[i:i + per] for i in range(0, flat.numel(), per)]


def _merge(parts: list[TensorStats]) -> TensorStats:
    """One tensor's statistics from those of disjoint parts of it."""
    counts = ("numel", "nan", "inf", "zeros", "fp16_overflow", "fp16_flush", "bf16_overflow", "bf16_flush")
    tops = [p.abs_max for p in parts if p.abs_max is not None]
    lows = [p.min_nonzero for p in parts if p.min_nonzero is not None]
    return TensorStats(**{c: sum(getattr(p, c) for p in parts) for c in counts},
                       abs_max=max(tops) if tops else None, min_nonzero=min(lows) if lows else None)

"""Streams tensors through range-statistics accumulators (``_rangestats``): in chunks or in one kernel
call, split between threads, one tensor or a pair read side by side.

The statistics and the two ways of computing them (the compiled ``analyzer/_scan.c`` and numpy) are
described in ``analyzer/_rangestats.py``. A large tensor is split between ``Workspace.threads`` threads
(both release the GIL); see ``bench/inspect_throughput.py`` for what each choice measured.
"""
from __future__ import annotations

import math
import queue
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._rangestats import (
    BF16_FLUSH, BF16_OVERFLOW, FP16_FLUSH, FP16_MAX, FP16_OVERFLOW, TensorStats, _Acc, compiled,
    scan_pair_into,
)

__all__ = [
    "KERNEL", "CHUNK", "THREAD_CHUNK", "FP16_MAX", "FP16_OVERFLOW", "FP16_FLUSH", "BF16_OVERFLOW", "BF16_FLUSH",
    "TensorStats", "PairChange", "Workspace", "scan_tensor", "scan_tensors", "scan_pair", "scan_pairs",
]

KERNEL = "c" if compiled() else "numpy"  # what Workspace() uses by default
KERNEL_STEP = 1 << 24  # elements per kernel call (64 MiB of float32): progress moves on huge tensors
CHUNK = 1 << 17  # elements (512 KiB of float32): chunk + scratch fit a 1 MiB L2; measured best of 64K..1M
SPLIT_AT = 1 << 26  # elements: scan_tensors scans smaller tensors whole, one per thread (bench: --threads)
THREAD_CHUNK = 1 << 19  # with threads: shorter numpy calls lose more to GIL hand-offs than cache gives back


@dataclass(frozen=True)
class PairChange:
    """How tensor B differs from tensor A of the same shape."""

    changed: int            # elements with a != b (NaN counts as changed)
    numel: int
    rel_change: float | None  # ||b - a|| / ||a|| (L2); None when ||a|| is 0 or either holds NaN/Inf

    @property
    def stalled(self) -> bool:
        return self.changed == 0


class Workspace:
    """Scratch buffers reused across tensors, so a scan allocates O(CHUNK) per thread, never O(tensor).

    ``kernel`` is ``"c"`` (the compiled scan, the default when it was built: float32 data goes to it in
    one call per part) or ``"numpy"`` (chunks of ``chunk``). Both release the GIL, so threads help:
    ``scan_tensor`` splits a tensor of at least ``16 * part_chunk`` elements into up to ``threads``
    contiguous parts of at least 8 chunks of ``part_chunk``; ``scan_tensors`` scans tensors under
    ``split_at`` elements whole, side by side. ``threads`` defaults to ``torch.get_num_threads()``, so
    ``torch.set_num_threads(1)`` (or ``OMP_NUM_THREADS=1``) keeps the scan on one core. ``chunk``
    defaults to ``CHUNK``, ``part_chunk`` to ``THREAD_CHUNK`` (or ``chunk`` when given), ``split_at``
    to ``SPLIT_AT``; all were measured with ``bench/inspect_throughput.py``.

    Example:
        >>> with Workspace() as ws:
        ...     s = scan_tensor(torch.ones(10), ws)
    """

    def __init__(self, chunk: int | None = None, threads: int | None = None, kernel: str | None = None,
                 split_at: int | None = None):
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        kernel = kernel or KERNEL
        if kernel not in ("c", "numpy"):
            raise ValueError(f"kernel must be 'c' or 'numpy', got {kernel!r}")
        if kernel == "c" and not compiled():
            raise ValueError("kernel='c' needs analyzer._scan, which was not compiled at install "
                             "(reinstall with a C compiler present)")
        self.kernel = kernel
        self.threads = max(1, torch.get_num_threads() if threads is None else threads)
        self.chunk = chunk or CHUNK
        self.part_chunk = chunk or THREAD_CHUNK
        self.split_at = split_at or SPLIT_AT
        self._bufs: dict[tuple[str, int, np.dtype], np.ndarray] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()  # scratch slots free for a whole-tensor task
        for slot in range(self.threads):
            self._slots.put(slot)
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
        futures = [self.pool().submit(f) for f in fns[1:]]
        first = fns[0]()
        return [first] + [f.result() for f in futures]

    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="amp-autopsy-scan")
        return self._pool

    def with_slot(self, task: Callable[[Any, int], Any], item: Any) -> Any:
        """task(item, slot) on the scratch of a free slot: safe to run on several threads at once."""
        slot = self._slots.get()
        try:
            return task(item, slot)
        finally:
            self._slots.put(slot)

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
_KERNEL_KIND = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}  # what _scan.c reads natively


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
    acc = _Acc(flat.numel(), ws.kernel == "c")
    item = flat.element_size()
    kind = _KERNEL_KIND.get(flat.dtype)
    # NB: the kernel needs element-aligned data (it refuses any other); torch.save storages are 64-byte
    # aligned, and _safetensors copies a tensor that starts off its alignment in the file
    if acc.kernel and kind is not None:
        view = flat.numpy() if kind == "f32" else flat.view(torch.int16).numpy()  # 16-bit kinds: their bits
        for i in range(0, view.size, KERNEL_STEP):
            x = view[i:i + KERNEL_STEP]
            acc.add_scanned(x, kind)
            if on_bytes is not None:
                on_bytes(x.size * item)
        return acc
    a, m = ws.buf("abs", dtype, slot), ws.buf("mask", np.bool_, slot)
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
    total = _Acc(flat.numel(), ws.kernel == "c")
    for acc in accs:
        total.merge(acc)
    return total.freeze()


def _side_by_side(ws: Workspace, items: list[Any], task: Callable[[Any, int], Any], nbytes: Callable[[Any], int],
                  on_bytes: Callable[[int], None] | None) -> list[Any]:
    """task(item, slot) for every item, on the workspace's threads at once; results and progress in order."""
    futures = [ws.pool().submit(ws.with_slot, task, item) for item in items]
    out = []
    for item, fut in zip(items, futures):
        out.append(fut.result())
        if on_bytes is not None:
            on_bytes(nbytes(item))
    return out


def scan_tensors(ts: Sequence[torch.Tensor], ws: Workspace,
                 on_bytes: Callable[[int], None] | None = None) -> list[TensorStats]:
    """Statistics of many tensors, in order.

    With threads, tensors under ``ws.split_at`` (default ``SPLIT_AT``) elements are scanned whole and
    side by side, one per thread, so no thread waits for the others after every tensor (splitting each
    tensor in two measured 1.11x of the floor on 2 threads, tensors side by side 1.02x). Larger ones
    are split as ``scan_tensor`` splits them. Progress is reported on this thread, tensor by tensor, in
    order.

    Example:
        >>> with Workspace(threads=2) as ws:
        ...     [s.abs_max for s in scan_tensors([torch.ones(3), torch.full((2,), -4.0)], ws)]
        [1.0, 4.0]
    """
    if ws.threads == 1:
        return [scan_tensor(t, ws, on_bytes) for t in ts]

    def whole(t: torch.Tensor, slot: int) -> TensorStats:  # part_chunk: the chunks of threads side by side
        return _scan_part(_flat(t.detach()), ws, slot, _np_dtype(t), ws.part_chunk, None).freeze()

    out: list[TensorStats] = []
    batch: list[torch.Tensor] = []
    for t in [*ts, None]:
        if t is None or t.numel() >= ws.split_at:
            out += _side_by_side(ws, batch, whole, lambda x: x.nbytes, on_bytes)
            batch = []
            if t is not None:
                out.append(scan_tensor(t, ws, on_bytes))
        else:
            batch.append(t)
    return out


def scan_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], ws: Workspace,
               on_bytes: Callable[[int], None] | None = None) -> list[tuple[TensorStats, TensorStats, PairChange]]:
    """scan_pair for each (A, B), in order; with threads, pairs run side by side, one per thread."""
    if ws.threads == 1:
        return [scan_pair(ta, tb, ws, on_bytes) for ta, tb in pairs]
    return _side_by_side(ws, list(pairs), lambda p, slot: scan_pair(p[0], p[1], ws, None, slot, ws.part_chunk),
                         lambda p: p[0].nbytes + p[1].nbytes, on_bytes)


def scan_pair(ta: torch.Tensor, tb: torch.Tensor, ws: Workspace,
              on_bytes: Callable[[int], None] | None = None, slot: int = 0,
              step: int | None = None) -> tuple[TensorStats, TensorStats, PairChange]:
    """Statistics of A and B (same shape) and how B differs from A, reading each chunk once.
    `slot` picks the workspace scratch (one per thread), `step` the chunk (default ``ws.chunk``)."""
    if ta.shape != tb.shape:
        raise ValueError(f"shapes differ: {tuple(ta.shape)} vs {tuple(tb.shape)}")
    dtype = _np_dtype(ta, tb)
    acc_a, acc_b = _Acc(ta.numel(), ws.kernel == "c"), _Acc(tb.numel(), ws.kernel == "c")
    changed, dd, aa = 0, 0.0, 0.0
    item = ta.element_size() + tb.element_size()
    if ta.stride() == tb.stride():  # the same memory order: flat views pair element with element
        fa, fb = _flat(ta.detach()), _flat(tb.detach())
    else:  # NB: copies, so that element i of A and of B are the same index
        fa, fb = ta.detach().contiguous().reshape(-1), tb.detach().contiguous().reshape(-1)
    if acc_a.kernel and fa.dtype == fb.dtype == torch.float32:  # one compiled read of each block of both
        va, vb = fa.numpy(), fb.numpy()
        for i in range(0, va.size, KERNEL_STEP):
            c, d2, a2 = scan_pair_into(acc_a, acc_b, va[i:i + KERNEL_STEP], vb[i:i + KERNEL_STEP])
            changed, dd, aa = changed + c, dd + d2, aa + a2
            if on_bytes is not None:
                on_bytes(min(KERNEL_STEP, va.size - i) * item)
        return _pair_result(acc_a, acc_b, changed, dd, aa)
    a, m, d = ws.buf("abs", dtype, slot), ws.buf("mask", np.bool_, slot), ws.buf("diff", dtype, slot)
    compiled_pair = acc_a.kernel and dtype == np.float32
    with np.errstate(all="ignore"):  # inf - inf and overflowing squares are expected, not warnings
        for xa, xb in zip(_chunks(fa, ws, "a", dtype, slot, step), _chunks(fb, ws, "b", dtype, slot, step)):
            k = xa.size
            if compiled_pair:  # pairs not both float32, converted in chunks: the same call as above
                c, d2, a2 = scan_pair_into(acc_a, acc_b, xa, xb)
                changed, dd, aa = changed + c, dd + d2, aa + a2
            else:  # NB: float32 dot products (float64 ones would cost a converting pass)
                acc_a.fold(xa, a, m)
                acc_b.fold(xb, a, m)
                changed += int(np.count_nonzero(np.not_equal(xa, xb, out=m[:k])))
                np.subtract(xb, xa, out=d[:k])
                dd += float(np.dot(d[:k], d[:k]))
                aa += float(np.dot(xa, xa))
            if on_bytes is not None:
                on_bytes(k * item)
    return _pair_result(acc_a, acc_b, changed, dd, aa)


def _pair_result(acc_a: _Acc, acc_b: _Acc, changed: int, dd: float, aa: float):
    sa, sb = acc_a.freeze(), acc_b.freeze()
    ok = sa.nonfinite == 0 and sb.nonfinite == 0 and aa > 0 and math.isfinite(dd) and math.isfinite(aa)
    rel = math.sqrt(dd) / math.sqrt(aa) if ok else None
    return sa, sb, PairChange(changed=changed, numel=acc_a.numel, rel_change=rel)

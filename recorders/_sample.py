"""The fixed sample of every parameter and its gradient: a layer row's update columns, ``param_norm`` and ``grad_zero_frac``.

``UpdateSample`` keeps a fixed sample of each parameter on the device (all elements up to
``SAMPLE``, else ``BLOCKS`` evenly spaced runs of contiguous elements; no RNG) and compares it with
the weights at the next recorded layer row (``update_rms``, ``unchanged_frac``); the same sample
of each gradient gives its zero fraction. The parameter norm is the sample's, scaled to the whole
parameter: exact up to ``SAMPLE`` elements, an estimate beyond; so is the zero fraction. No host
sync, and a fixed number of ops per parameter dtype (one of them, a ``_foreach_copy_``, loops over the
parameters in C++).

Example:
    >>> model = torch.nn.Linear(4, 2)
    >>> sample = UpdateSample(list(model.parameters()), torch.device("cpu"))
    >>> sample.measure()[2]    # first call: nothing to compare with yet
    [False, False]
    >>> with torch.no_grad():
    ...     _ = model.weight.add_(1.0)
    >>> rms, unchanged, has, norm, zero_frac = sample.measure([torch.zeros(2, 4), None])
    >>> rms.tolist(), unchanged.tolist(), has
    ([1.0, 0.0], [0.0, 1.0], [True, True])
    >>> zero_frac.tolist()[0]  # the weight's gradient was all zeros; the bias had none given
    1.0
"""
from __future__ import annotations

import collections
import math
import operator
from typing import NamedTuple

import torch

from ._stats import local_tensor

__all__ = ["SAMPLE", "BLOCKS", "sample_view", "Measured", "UpdateSample"]

SAMPLE = 4096  # elements sampled per parameter for update_rms / unchanged_frac (at most)
BLOCKS = 64    # ... in this many evenly spaced runs of contiguous elements
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-size integer views
_NORM, _RMS, _UNCHANGED, _ZERO = 0, 1, 2, 3  # rows of measure_into's `out`
_data_ptr = torch.Tensor.data_ptr


def _blocks(numel: int) -> tuple[int, int, int]:
    """(blocks, block length, step between block starts) of a tensor's sample.

    All elements up to SAMPLE; beyond, BLOCKS evenly spaced runs of SAMPLE // BLOCKS contiguous
    elements. Contiguous runs read whole cache lines: a one-element stride over a large
    embedding touches a new cache line (and often a new page) per element, ~10x slower.
    """
    if numel <= SAMPLE:
        return 1, numel, numel
    return BLOCKS, SAMPLE // BLOCKS, numel // BLOCKS


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as one dimension in memory order: a view when `t` is dense in some dim order
    (contiguous, channels_last), else a copy."""
    if t.is_contiguous():
        return t.view(-1)
    dense = t.permute(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return dense.view(-1) if dense.is_contiguous() else t.reshape(-1)


def sample_view(t: torch.Tensor) -> torch.Tensor:
    """The ``(blocks, length)`` sample of `t`, in memory order (a view of its storage when `t` is
    dense: contiguous or channels_last)."""
    b, n, step = _blocks(t.numel())
    return _memory_order(t).as_strided((b, n), (step, 1))


def _width(count: int) -> int:
    """The row width a sample of `count` elements is laid out in: the next power of two."""
    return 1 << max(0, count - 1).bit_length()


def _grad_sample(g: torch.Tensor | None, size: tuple[int, int], stride: tuple[int, int]) -> torch.Tensor | None:
    """The sample of a gradient larger than SAMPLE: ``sample_view``, taken directly when contiguous."""
    if g is None:
        return None
    return g.as_strided(size, stride) if g.is_contiguous() else sample_view(g)


class _Group:
    """Parameters of one device and dtype: their samples (and their gradients') in flat buffers.

    Each parameter's sample fills the start of a row of ``_width(count)`` elements; rows of one
    width are contiguous, widest first, so every per-parameter sum is one row sum of a 2-d view
    (``segment_reduce`` measured ~5x slower on CPU). The padding stays zero in every buffer.
    1-d parameters of at most ``SAMPLE`` elements whose size another shares get rows of exactly
    that size, side by side: each such run is copied by one ``torch.cat`` (cache-cold after a
    step, one copy per tensor costs 1-3 us each, mostly its metadata's cache misses).

    NB: a parameter of at most ``SAMPLE`` elements is its own sample: it and its gradient are
    copied whole, with no view (in logical order: each statistic of a whole sample is a sum over
    its elements, whatever their order, and both samples compared are in the same order). The
    larger ones, first, are sampled through views: made once for the weights, taken afresh for
    each step's gradients. Making a view is a tensor allocation, the most costly Python per
    parameter; a step makes one per sampled gradient.
    """

    def __init__(self, tensors: list[torch.Tensor], index: list[int], out: torch.device):
        device, dtype = tensors[0].device, tensors[0].dtype
        # 1-d tensors of at most SAMPLE elements whose size another shares (biases, norm weights) get
        # rows of exactly their size, side by side: each size's run is copied by one torch.cat
        sizes = collections.Counter(t.numel() for t in tensors if t.dim() == 1 and t.numel() <= SAMPLE)

        def width(t: torch.Tensor) -> int:
            n = t.numel()
            return n if t.dim() == 1 and n <= SAMPLE and sizes[n] > 1 else _width(min(n, SAMPLE))

        order = sorted(range(len(index)), key=lambda j: (-width(tensors[j]), tensors[j].numel() <= SAMPLE,
                                                          tensors[j].numel(), tensors[j].dim() != 1))
        tensors = [tensors[j] for j in order]
        self.index = [index[j] for j in order]
        self.sampled = sum(t.numel() > SAMPLE for t in tensors)  # the first `sampled` go through views
        blocks = [_blocks(t.numel()) for t in tensors]
        self.strided = [((b, n), (step, 1)) for b, n, step in blocks[:self.sampled]]  # a contiguous gradient's
        counts = [b * n for b, n, _ in blocks]
        shapes = [(b, n) for b, n, _ in blocks[:self.sampled]] + [t.shape for t in tensors[self.sampled:]]
        widths = [width(t) for t in tensors]
        offsets = [sum(widths[:i]) for i in range(len(widths))]
        total = sum(widths)
        self.rows: list[tuple[int, int, int, int]] = []  # (offset, first tensor, tensors, width) per width
        for j, (w, o) in enumerate(zip(widths, offsets)):
            if self.rows and self.rows[-1][3] == w:
                self.rows[-1] = self.rows[-1][:2] + (self.rows[-1][2] + 1, w)
            else:
                self.rows.append((o, j, 1, w))
        # runs (first, end) of 1-d tensors of one size that fill their rows: one torch.cat per run and buffer
        runs: list[tuple[int, int]] = []
        for j in range(self.sampled, len(tensors)):
            if tensors[j].dim() == 1 and widths[j] == counts[j] and sizes[counts[j]] > 1:
                if runs and runs[-1][1] == j and counts[runs[-1][0]] == counts[j]:
                    runs[-1] = (runs[-1][0], j + 1)
                else:
                    runs.append((j, j + 1))
        runs = [(a, b) for a, b in runs if b - a > 1]
        in_runs = {j for a, b in runs for j in range(a, b)}
        self.each = [j for j in range(len(tensors)) if j not in in_runs]  # copied one by one (_foreach_copy_)
        self.each_small = [j for j in self.each if j >= self.sampled]
        # NB: views of the parameters' own storage, made once (UpdateSample rebuilds the groups when a
        # storage is replaced). A sampled parameter that is not dense is sampled afresh at every call.
        self.tensors = tensors
        self.dense = all(_memory_order(t).data_ptr() == t.data_ptr() for t in tensors[:self.sampled])
        self.sources = [sample_view(t) for t in tensors[:self.sampled]] + tensors[self.sampled:] \
            if self.dense else None
        self.each_sources = [self.sources[j] for j in self.each] if self.dense else None
        # three zeroed buffers: the weights' samples now and at the previous call (swapped at
        # every call: no allocation per call), and the gradients'
        self.bufs = [torch.zeros(total, dtype=dtype, device=device) for _ in range(3)]
        self.dsts = [[buf[o:o + c].view(shape) for o, c, shape in zip(offsets, counts, shapes)] for buf in self.bufs]
        each = [[d[j] for j in self.each] for d in self.dsts]
        self.each_dsts = each[:2]
        self.both = [each[0] + each[2], each[1] + each[2]]  # weights now, then gradients
        # (tensors, and the run's rows in each of the three buffers)
        self.runs = [(tensors[a:b], a, b, [buf[offsets[a]:offsets[b - 1] + counts[b - 1]] for buf in self.bufs])
                     for a, b in runs]
        self.pick = operator.itemgetter(*self.index) if len(self.index) > 1 else lambda s, i=self.index[0]: (s[i],)
        self.flip = 0
        self.filled = False
        self.work = torch.float64 if dtype == torch.float64 else torch.float32
        self.cast = self.work != dtype  # float16/bfloat16 samples: squared and subtracted in float32
        bits = _BITS[tensors[0].element_size()]
        self.bits = [buf.view(bits) for buf in self.bufs[:2]]
        # per element: the weight squared, the change squared, bits unchanged, gradient zero
        self.scratch = torch.empty(4, total, dtype=self.work, device=device)
        self.scratch_rows = self.scratch.unbind(0)
        self.sums = torch.empty(4, len(tensors), dtype=self.work, device=device)
        self.result = torch.empty(4, len(tensors), dtype=self.work, device=device)
        self.roots = self.result[:2]
        self.blocks = [(self.scratch[:, o:o + k * w].view(4, k, w), self.sums[:, j:j + k]) for o, j, k, w in self.rows]
        self.as_out = self.work == torch.float32 and device == out  # result written as it is
        # NB: built once: a host-to-device copy from pageable memory would wait for the device.
        # result = (sums - minus) / over, then the first two rows' square roots:
        # norm = sqrt(sum of squares * numel / count), rms = sqrt(sum of squared changes / count),
        # and the fractions of bit-unchanged and zero elements (less the padding, counted in)
        pad = [float(w - c) for w, c in zip(widths, counts)]
        self.minus = torch.tensor([[0.0] * len(pad), [0.0] * len(pad), pad, pad], dtype=self.work, device=device)
        self.over = torch.tensor([[c / t.numel() for t, c in zip(tensors, counts)], counts, counts, counts],
                                 dtype=self.work, device=device)
        self.where = torch.tensor(self.index, dtype=torch.long, device=out)  # positions in the per-parameter output
        self._missing: tuple[tuple[int, ...], torch.Tensor | None] = ((), None)

    def sample(self, grads: list[torch.Tensor | None] | None) -> list[int] | None:
        """Copy the weights' samples into this call's buffer and the gradients' into the gradient
        buffer: one ``_foreach_copy_`` and one ``torch.cat`` per run of equal sizes; returns the group
        positions of the missing gradients (None: no gradients given)."""
        flip = self.flip
        if self.dense:
            srcs = self.each_sources
        else:
            srcs = [sample_view(t) for t in self.tensors[:self.sampled]] + self.tensors[self.sampled:]
            srcs = [srcs[j] for j in self.each]
        dsts = self.each_dsts[flip]
        missing = None
        if grads is not None:
            got = self.pick(grads)
            missing = [j for j, g in enumerate(got) if g is None]
            # NB: gradients are new tensors at every step (zero_grad(set_to_none=True)): views taken afresh
            if not missing:
                dsts, srcs = self.both[flip], srcs + [
                    g.as_strided(size, stride) if g.is_contiguous() else sample_view(g)
                    for g, (size, stride) in zip(got, self.strided)] + [got[j] for j in self.each_small]
                for _, a, b, outs in self.runs:
                    torch.cat(got[a:b], out=outs[2])
            elif len(missing) < len(got):
                k = self.sampled
                gsrcs = [_grad_sample(g, size, stride) for g, (size, stride) in zip(got, self.strided)] + list(got[k:])
                torch._foreach_copy_([d for d, g in zip(self.dsts[2], gsrcs) if g is not None],
                                     [g for g in gsrcs if g is not None])
        if dsts:  # (empty when every tensor is in a run)
            torch._foreach_copy_(dsts, srcs)
        for weights, _, _, outs in self.runs:
            torch.cat(weights, out=outs[flip])
        return missing

    def missing_index(self, missing: list[int]) -> torch.Tensor:
        """Device index tensor of `missing`, cached: building it is a host-to-device copy."""
        key = tuple(missing)
        if self._missing[0] != key:
            self._missing = (key, torch.tensor(missing, dtype=torch.long, device=self.result.device))
        return self._missing[1]

    def measure(self, grads: list[torch.Tensor | None] | None) -> torch.Tensor:
        """``(4, tensors)``: norm, rms, unchanged, zero fraction (see UpdateSample); float32 on the
        output device, or the work dtype when that is not float32 (float64 parameters)."""
        missing = self.sample(grads)
        now, then = self.flip, 1 - self.flip
        cur, prev = self.bufs[now], self.bufs[then]
        sq, dsq, kept, zero = self.scratch_rows
        if self.cast:
            sq.copy_(cur).mul_(sq)  # NB: cast into the preallocated buffer, then squared
            dsq.copy_(cur).sub_(prev).mul_(dsq)  # (in the work dtype: the old value is promoted)
        else:
            torch.mul(cur, cur, out=sq)
            # (cur - prev) * (cur - prev) in one kernel (reduction 0: none): sub then mul's values, one pass less
            torch._C._nn.mse_loss(cur, prev, 0, out=dsq)
        # NB: into a preallocated float buffer: a bool tensor cast to float costs ~3x the comparison
        torch.eq(self.bits[now], self.bits[then], out=kept)
        if grads is not None:
            torch.eq(self.bufs[2], 0, out=zero)
        for rows, sums in self.blocks:
            torch.sum(rows, 2, out=sums)
        r = torch.sub(self.sums, self.minus, out=self.result).div_(self.over)
        self.roots.sqrt_()
        if missing is None:
            r[_ZERO].fill_(math.nan)
        elif missing:
            r[_ZERO].index_fill_(0, self.missing_index(missing), math.nan)
        if not self.filled:  # nothing to compare with yet
            r[_RMS:_UNCHANGED + 1].fill_(math.nan)
        self.flip, self.filled = then, True
        return r


class Measured(NamedTuple):
    """``UpdateSample.measure()``: per-parameter float32 tensors on the Recorder's device, a host list."""

    rms: torch.Tensor        # update_rms
    unchanged: torch.Tensor  # unchanged_frac
    has: list[bool]          # which rms / unchanged entries are meaningful
    norm: torch.Tensor       # param_norm from the sample; every entry meaningful
    zero_frac: torch.Tensor  # grad_zero_frac from the gradients' sample; NaN where no gradient was given


class UpdateSample:
    """Per-parameter statistics of a layer row, measured on a fixed sample, on the device.

    ``measure(grads)`` returns a ``Measured``, one float32 entry per parameter, on `device`
    (``measure_into`` writes the same rows into a tensor of the caller's):

    - ``rms``, ``unchanged`` (with ``has``, a host list saying which entries are meaningful: a
      floating-point parameter measured before, with the same dtype, size and storage):
      ``update_rms`` is the RMS of ``w_now - w_then`` over the sample (in float32; float64 for
      float64 parameters), NaN once a sampled weight is NaN; ``unchanged_frac`` the fraction of
      sampled elements whose bits did not change;
    - ``norm``: the L2 norm of the sample scaled by ``sqrt(numel / sampled)``: the parameter's
      norm when it has at most ``SAMPLE`` elements (all are sampled), an estimate beyond; a
      NaN/Inf inside the sample makes it NaN/Inf;
    - ``zero_frac``: the fraction of exact zeros in the same sample of each gradient given
      (``grads[i]`` is parameter ``i``'s, or None): exact up to ``SAMPLE`` elements, an
      estimate beyond (contiguous runs: whole zero rows of an embedding are seen as such, but
      only ``BLOCKS`` rows are looked at). A NaN counts as non-zero.

    Every statistic is one row sum over a few thousand elements per parameter: about 2 x 4096
    elements read per parameter, a fixed number of ops per parameter dtype, no host sync.

    NB: the sample (``sample_view``: all elements, or 64 evenly spaced runs of 64 in memory
    order) is fixed by the size: no random numbers, so training's RNG stream is untouched, and
    the same elements are compared every time.
    """

    def __init__(self, params: list[torch.Tensor], device: torch.device):
        self.params = params
        self.device = device
        self._sharded = any(callable(getattr(p, "to_local", None)) for p in params)
        # NB: laid out now, at setup: building the groups copies small index tensors to the device,
        # which waits for it. measure() rebuilds only when a parameter's storage is replaced.
        self._rebuild()

    def key(self) -> list[int]:
        """Where each parameter's storage is: a new one (``p.data = ...``, ``module.to()``) moves it.

        NB: the groups' views keep the old storages alive, so a new storage never gets an old address."""
        if self._sharded:
            return [local_tensor(p).data_ptr() for p in self.params]
        return list(map(_data_ptr, self.params))

    def _rebuild(self) -> None:
        """Group the floating-point parameters by (device, dtype); every sample starts afresh."""
        tensors = [local_tensor(p).detach() for p in self.params]
        by: dict[tuple, list[int]] = {}
        for i, t in enumerate(tensors):
            if t.is_floating_point() and t.numel() and t.element_size() in _BITS:
                by.setdefault((t.device, t.dtype), []).append(i)
        self._groups = [_Group([tensors[i] for i in idx], idx, self.device) for idx in by.values()]
        grouped = {i for idx in by.values() for i in idx}
        self._others = [i for i in range(len(tensors)) if i not in grouped]  # empty, integer or complex128
        self._tensors = tensors
        self._has = [False] * len(tensors)
        self._ptrs = self.key()

    def measure(self, grads: list[torch.Tensor | None] | None = None) -> Measured:
        """Compare each parameter's sample with the previous call's and keep the new one; sample `grads`."""
        out = torch.empty(4, len(self.params), dtype=torch.float32, device=self.device)
        with torch.no_grad():
            has = self.measure_into(out, grads)
        return Measured(out[_RMS], out[_UNCHANGED], has, out[_NORM], out[_ZERO])

    def measure_into(self, out: torch.Tensor, grads: list[torch.Tensor | None] | None = None,
                     key: list[int] | None = None) -> list[bool]:
        """``measure`` into `out`, a float32 ``(4, params)`` tensor on `device`: its rows are ``norm``,
        ``rms``, ``unchanged`` and ``zero_frac``, every entry written. Returns ``has`` (never mutated).

        `key`: ``key()`` if the caller just took it (while the parameters were in cache). NB: call it
        under ``torch.no_grad()``: it copies from the parameters."""
        if (self.key() if key is None else key) != self._ptrs:  # parameters replaced: start over
            self._rebuild()
        if self._others:  # rare: measured whole
            out.fill_(math.nan)
        for i in self._others:
            t = self._tensors[i]
            out[_NORM, i] = torch.linalg.vector_norm(t if t.is_floating_point() or t.is_complex()
                                                     else t.double()).float()
            if grads is not None and grads[i] is not None and grads[i].numel():
                out[_ZERO, i] = 1.0 - torch.count_nonzero(grads[i]) / grads[i].numel()
        has, first = self._has, [g for g in self._groups if not g.filled]
        for g in self._groups:
            r = g.measure(grads)
            out.index_copy_(1, g.where, r if g.as_out else r.to(out.device, out.dtype))
        if first:  # measured from the next call on; a new list: the one returned is never mutated
            self._has = list(has)
            for g in first:
                for i in g.index:
                    self._has[i] = True
        return has

"""How tensor B differs from tensor A of the same shape: the float64 sums behind ``PairChange``.

``Scanner.pair`` folds each chunk of A and B into a ``Change`` after scanning them; ``result()`` gives
sum(a**2), sum((b - a)**2) and how many elements changed, the same on any SIMD width.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["PAIR_STEP", "Change"]

PAIR_STEP = 1 << 15   # elements per float64 step of a pair on the CPU (three rows: 768 KiB, in L2)
_SUM_COLS = 64        # float64 sums run down 64 columns, then math.fsum: the same on any SIMD width
_ONE = 2.0 ** -298    # the least non-zero square of a difference of float32s: 2**-149 (float32's least), squared


class Change:
    """Running float64 sums of a pair, in steps of `step` elements: sum(a**2), sum((b - a)**2), and
    _ONE per changed element. `narrow`: neither side is float64; `scratch(k)`: a float64 buffer of k.

    NB: each row is summed down _SUM_COLS fixed columns, each in element order, into running column sums
    (``math.fsum`` over them at the end): a plain ``sum`` would group by the SIMD width, and the last bits
    would depend on the CPU. A difference of two finite float32 (or narrower) values is 0 exactly when
    they are equal as floats (+0 and -0 included), and its square, when not 0, is at least _ONE, so
    clamping the squares to _ONE counts the changes in the same pass as the sums. Where a side holds NaN
    or inf, or is float64, the changes are counted by compares instead.
    """

    def __init__(self, step: int, narrow: bool, scratch: Callable[[int], torch.Tensor]):
        width = -(-step // _SUM_COLS) * _SUM_COLS
        self.rows = scratch(3 * width).view(3, width)  # float64, on the scan's device
        self.sums = torch.zeros(3, _SUM_COLS, dtype=torch.float64, device=self.rows.device)
        self.part = torch.empty_like(self.sums)
        self.step, self.narrow, self.compared = step, narrow, 0
        self.full = self._views(step, 3)  # the views of a whole step, made once

    def _views(self, k: int, used: int) -> tuple[torch.Tensor, ...]:
        """a, d, their squares, the clamped row, the summed view and its output, for a step of k elements."""
        m = -(-k // _SUM_COLS) * _SUM_COLS
        r = self.rows
        return (r[0, :k], r[1, :k], r[:2, :k], r[2, :k], r[:used, :m].view(used, -1, _SUM_COLS),
                self.part[:used], self.sums[:used])

    def add(self, xa: torch.Tensor, xb: torch.Tensor, finite: bool) -> None:
        """Fold in a chunk of A and the same of B, in steps."""
        count = finite and self.narrow
        for i in range(0, xa.numel(), self.step):
            sa, sb = xa[i:i + self.step], xb[i:i + self.step]
            k = sa.numel()
            full = count and k == self.step and k % _SUM_COLS == 0
            a, d, sq, ones, summed, part, sums = self.full if full else self._views(k, 3 if count else 2)
            a.copy_(sa)
            d.copy_(sb)
            if not count:
                self.compared += int((a != d).sum())
            d.sub_(a)
            sq.mul_(sq)
            if count:
                torch.clamp(d, max=_ONE, out=ones)
            if summed.numel() > sq.numel():  # a ragged last row: zeros add nothing
                self.rows[:summed.shape[0], k:summed.shape[1] * _SUM_COLS].zero_()
            torch.sum(summed, 1, out=part)
            sums.add_(part)

    def result(self) -> tuple[float, float, int]:
        """(sum(a**2), sum((b - a)**2), elements changed)."""
        aa, dd, ones = (math.fsum(r) for r in self.sums.tolist())
        return aa, dd, self.compared + round(ones / _ONE)  # exact: a sum of multiples of _ONE, < 2**53 of them

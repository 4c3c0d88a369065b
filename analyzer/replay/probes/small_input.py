"""Probe ``small_input``: an overflow whose value is large because an input is small, and where it got small.

For an ``overflow`` at a reciprocal, a division, an ``rsqrt``, a ``log`` or a negative power, the number
that matters is the smallest non-zero |input| (the divisor, the argument), not the abs-max: ``1 / 8.4e-6``
passes FP16's 65504. The evidence names it (and the exact zeros), the op that produced that input, and,
following the producers back, the cast that brought the value into the low precision (``aten._to_copy``,
the user's ``.to(x.dtype)``, ``.half()``, ``.type_as``, or autocast's own), with source lines. The
summary ends with that sentence; the ``overflow`` advice names the region to keep in FP32, from the
cast to the culprit (untested: the replay does not edit the code).

Real output (a denoiser whose loss casts its noise level sigma to the prediction's dtype, then weights by
``1 / sigma**2``)::

    ... Its input was small, not large: the smallest non-zero |x| of aten.reciprocal's input is 1.29e-05
    (float16), made by aten.pow in <loss_fn> at tests/analyzer/replay/denoiser_models.py:43; the value
    became float16 at aten._to_copy in <loss_fn> at tests/analyzer/replay/denoiser_models.py:42 (float32 -> float16).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..result.trace import LOW_PRECISION
from .registry import ProbeInput, probe

if TYPE_CHECKING:
    from ..result.diagnosis import Diagnosis

__all__ = ["SmallInput", "small_input"]

# op -> the argument whose smallness makes the result large
_ARG = {"aten.reciprocal": 0, "aten.rsqrt": 0, "aten.div": 1, "aten.log": 0, "aten.log2": 0, "aten.log10": 0,
        "aten.pow": 0}
_HOPS = 12  # producers followed back to find the cast


def _applies(d: Diagnosis) -> bool:
    return (d.verdict == "overflow" and d.culprit is not None and d.trace is not None
            and d.trace.captured is not None and d.culprit["op"] in _ARG)


def _dname(d) -> str | None:
    return None if d is None else str(d).removeprefix("torch.")


def _op(rec) -> dict[str, Any]:
    """The op as the evidence names it, with its dtypes (a cast reads ``float32 -> float16``)."""
    return {"op": rec.name, "module": rec.module, "source": rec.source, "index": rec.index,
            "input_dtypes": sorted(_dname(d) for d in rec.in_dtypes), "output_dtype": _dname(rec.out_dtype)}


def _where(op: dict) -> str:
    src = f" at {op['source']}" if op.get("source") else ""
    return f"{op['op']} in {op['module']}{src}"


@dataclass(frozen=True)
class SmallInput:
    """The culprit's small input: its smallest non-zero |x|, exact zeros, producer and the cast upstream."""

    op: str
    smallest: float
    zeros: int
    dtype: str
    producer: dict[str, Any] | None
    cast: dict[str, Any] | None

    def to_dict(self) -> dict:
        return {"small_input": {"op": self.op, "smallest_nonzero_abs": self.smallest, "zeros": self.zeros,
                                "dtype": self.dtype, "producer": self.producer, "cast": self.cast}}

    def note(self) -> str:
        made = f", made by {_where(self.producer)}" if self.producer else ""
        zeros = f" ({self.zeros} exact zero(s))" if self.zeros else ""
        cast = (f"; the value became {self.dtype} at {_where(self.cast)} "
                f"({', '.join(self.cast['input_dtypes']) or '-'} -> {self.cast['output_dtype']})" if self.cast else "")
        return (f"Its input was small, not large: the smallest non-zero |x| of {self.op}'s input is "
                f"{self.smallest:.3g}{zeros} ({self.dtype}){made}{cast}.")


@probe("small_input", when=_applies, into="result")
def small_input(inp: ProbeInput) -> SmallInput | None:
    d = inp.diagnosis
    trace, name = d.trace, d.culprit["op"]
    args = list(trace.captured[0])
    pos = _ARG[name]
    if name == "aten.pow" and not (len(args) > 1 and isinstance(args[1], (int, float)) and args[1] < 0):
        return None  # only a negative power makes a small base large
    x = args[pos] if len(args) > pos else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
        return None
    absx = x.detach().abs().float()
    nz = absx[absx > 0]
    smallest = float(nz.min()) if nz.numel() else 0.0  # NB: host syncs, on the diagnosis pass only
    zeros = int((absx == 0).sum())
    rec = trace.records[d.culprit["index"]]
    k = sum(1 for a in args[:pos] if isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel() > 0)
    producer_index = rec.inputs[k][1] if k < len(rec.inputs) else None
    producer = trace.records[producer_index] if producer_index is not None else None
    cast, cur = None, producer
    for _ in range(_HOPS):
        if cur is None:
            break
        out = _dname(cur.out_dtype)
        if cur.name == "aten._to_copy" and out in LOW_PRECISION and torch.float32 in cur.in_dtypes:
            cast = _op(cur)
            break
        nxt = next((p for _s, p in cur.inputs if p is not None), None)
        cur = trace.records[nxt] if nxt is not None else None
    return SmallInput(name, smallest, zeros, str(x.dtype).removeprefix("torch."),
                      None if producer is None else _op(producer), cast)


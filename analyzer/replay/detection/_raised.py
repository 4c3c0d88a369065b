"""An op that raised only in low precision is the culprit: a constant or value beyond the dtype's range.

``masked_fill(mask, -1e9)`` on an FP16 tensor, ``torch.full(..., 1e5, dtype=x.dtype)``, a ``.half()`` of an
out-of-range Python number: FP16 refuses them with ``RuntimeError: value cannot be converted to type
c10::Half without overflow``, while FP32 runs the step. Training kept the step as an ``exception`` snapshot;
the replay's low-precision run raises the same way (``_runs.OpRaised``), and that op, the first that raised,
is the culprit: verdict ``overflow``, with the error and the numbers it was given beyond the dtype's max
(``Culprit.raised``). An exception of another kind, or one FP32 raises too, stays the model code's one-line
error.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ._diagnose import _op_fields
from ..runs._runs import OpRaised
from ..result.diagnosis import Diagnosis
from ..result.records import Culprit

__all__ = ["raised_diagnosis"]

_OVERFLOW_WORDS = ("overflow", "out of range", "outside the range")


def raised_diagnosis(facts: Diagnosis, precision: str, e: OpRaised) -> Diagnosis | None:
    """The diagnosis of a low-precision run that raised in an op (the trace's last record), or None when
    the exception is not a value beyond `precision`'s range (then it stays an error)."""
    limit = float(torch.finfo(getattr(torch, precision)).max)
    beyond = [x for x in e.numbers if math.isfinite(x) and abs(x) > limit]
    if not beyond and not any(w in e.error.lower() for w in _OVERFLOW_WORDS):
        return None
    run = e.trace
    rec = run.records[-1]
    fields = {**_op_fields(run, rec.index), "output_kind": "raised", "output_dtype": None, "output_absmax": None}
    culprit = Culprit(**fields, raised={"error": e.error, "values": beyond[:4], "dtype_max": limit})
    return dataclasses.replace(facts, verdict="overflow", culprit=culprit, trace=run)

"""Typed replay records: ``OpRecord`` (one op as the report shows it) and ``Culprit`` (the op blamed).

They are frozen values built once, never patched afterwards: what a diagnosis adds to an op
(the shadow recomputation, the hidden or literal origin, the flush) is given when the
``Culprit`` is made. Each is also a read-only mapping of its JSON fields (``culprit["op"]``),
in the order the ``--json`` output has always had, with fields that do not apply left out.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["Culprit", "OpRecord", "hidden_first", "headline"]


class _Unset:
    """Marks a field that does not apply to this record: it is left out of the JSON."""

    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self) -> str:
        return "UNSET"  # NB: unpickled as the one marker (a distributed replay's ranks send records), never a copy


UNSET: Any = _Unset()


@dataclass(frozen=True, eq=False)
class OpRecord(Mapping):
    """One op of a replay: what it was, where it ran, and the ranges it saw.

    ``zeros`` / ``fp32_zeros`` are set only on the op where values flushed to zero (``underflow_at``).
    """

    op: str
    overload: str
    module: str | None
    phase: str
    precision: str
    index: int
    source: str | None
    node: Any
    input_dtypes: list
    output_dtype: str | None
    input_absmax: float | None
    output_absmax: float | None
    output_kind: str
    custom: bool
    zeros: Any = UNSET
    fp32_zeros: Any = UNSET
    source_path: Any = UNSET  # the absolute file:line of `source`, which is shown relative to the run's cwd

    def _present(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not UNSET]

    def __getitem__(self, key: str) -> Any:
        if not isinstance(key, str) or key.startswith("_") or key not in self._present():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._present())

    def __len__(self) -> int:
        return len(self._present())

    def to_dict(self) -> dict[str, Any]:
        return {k: (v.to_dict() if isinstance(v, OpRecord) else v) for k, v in self.items()}


@dataclass(frozen=True, eq=False)
class Culprit(OpRecord):
    """The op the verdict blames, with what the diagnosis found about it.

    Attributes (each left out of the JSON where it does not apply):
        input: the non-finite input it read first (verdict ``nonfinite_input``).
        shadow: its recomputation from the same inputs in FP32/FP64 (None when not recomputed).
        fp32_output_absmax: the same op's output abs-max in the FP32 run.
        literal_nonfinite / hidden: the op that wrote a literal -inf it carried on, or the
            earlier op whose NaN/Inf was masked before it surfaced (``OpRecord`` or None).
        underflow_at: the op where values flushed to zero (verdict ``underflow``).
        cancelled_at: the subtraction that cancelled in low precision (verdict ``cancellation``):
            ``op``, ``module``, ``source``, ``index``, abs-maxima, one element's ``example``
            (``a - b = result``) and the recognised ``pattern`` (``one_pass_variance``...).
        magnitude_jump: the op feeding it where the magnitude jumped the most (verdict ``overflow``;
            ``_magnitude.magnitude_jump``).
        micro_batch: in a step that accumulated gradients, the micro-batch (0-based) the op ran for.
        raised: the op raised instead of returning (only in low precision: FP32 ran the step):
            ``error`` (type and first line), ``values`` (the numbers it was given beyond the dtype's
            range), ``dtype_max``.
        surfaced_at: only on the ``headline`` of a hidden forward NaN/Inf: the backward op where it
            surfaced and made the step fail.
        precision_error: the op where a finite step's error against FP32 is born (verdict
            ``precision_error``, ``probes/precision.py``): ``kind`` (``computed``: its own error from its
            inputs; ``amplified``), ``local_error_eps``, ``error_eps``, ``input_error_eps``, the abs-maxima,
            ``accounts_for`` (``loss``, ``grad``: the share computing it in FP32 removes) and ``remaining``.
    """

    input: Any = UNSET
    shadow: Any = UNSET
    fp32_output_absmax: Any = UNSET
    literal_nonfinite: Any = UNSET
    hidden: Any = UNSET
    underflow_at: Any = UNSET
    cancelled_at: Any = UNSET
    magnitude_jump: Any = UNSET
    raised: Any = UNSET
    micro_batch: Any = UNSET
    surfaced_at: Any = UNSET
    precision_error: Any = UNSET


def hidden_first(culprit: Mapping | None) -> bool:
    """Whether the answer leads with the culprit's ``hidden`` op: a forward op made the NaN/Inf first, a later
    forward op hid it (the loss stayed finite), and the culprit is the backward op where it surfaced."""
    h = None if culprit is None else culprit.get("hidden")
    return h is not None and h["phase"] == "forward" and culprit["phase"] != "forward"


def headline(culprit: Culprit | None) -> Culprit | None:
    """The culprit as ``--json`` gives it: the op the answer leads with, first in time.

    Where a forward op's NaN/Inf was hidden and surfaced in backward (``hidden_first``), that forward op,
    with ``surfaced_at``: the backward op that made the step fail (the culprit the diagnosis worked from,
    its shadow and FP32 fields included); its ``hidden`` names the op itself, as ``hidden_nonfinite`` does.
    Any other culprit is returned as it is.
    """
    if culprit is None or not hidden_first(culprit):
        return culprit
    h = culprit["hidden"]
    return Culprit(**{f.name: getattr(h, f.name) for f in fields(OpRecord)}, hidden=h,
                   surfaced_at=replace(culprit, hidden=UNSET))

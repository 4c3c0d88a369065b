"""Typed values of a replay's diagnosis: ``Diagnosis`` (what was found, and the facts its wording
needs), ``SdpaCheck`` (the attention backends tried) and ``PrecisionRun`` (one precision's run).

They are frozen values: the detection (``_diagnose``) builds them once, the verdict registry
(``verdicts``) words them, and ``ReplayResult`` carries the JSON-facing ones.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .records import UNSET, OpRecord

if TYPE_CHECKING:
    from .trace import RunTrace
    from .records import Culprit

__all__ = ["Diagnosis", "SdpaCheck", "PrecisionRun"]


@dataclass(frozen=True)
class SdpaCheck:
    """The culprit's SDPA call and the same step re-run under each other attention backend.

    Attributes:
        backend: the backend the culprit's call ran (``math``, ``flash``...).
        backends: ``{backend: "finite" | "nonfinite at OP in `MODULE`" | "unavailable: why"}``.
        math_reduced_precision: the snapshot's ``allow_fp16_bf16_reduction_math_sdp`` switch.
    """

    backend: str | None
    backends: Mapping[str, str]
    math_reduced_precision: bool | None = None

    @property
    def finite(self) -> list[str]:
        """The backends on which the step is finite, in the order tried."""
        return [b for b, v in self.backends.items() if v == "finite"]

    def to_dict(self) -> dict:
        return {"backend": self.backend, "backends": dict(self.backends),
                "math_reduced_precision": self.math_reduced_precision}


@dataclass(frozen=True)
class Diagnosis:
    """What the replay found, and the facts of the step its summary and advice are written from.

    Attributes:
        verdict: a name in ``verdicts.VERDICTS``.
        culprit: the op blamed (None: healthy, or no op read the broken input).
        nonfinite_inputs: parameters, buffers and batch leaves NaN/Inf before the step
            (``param:fc.weight``, ``batch:x``).
        written_only: NaN/Inf buffers the step only writes (not a cause).
        masks: additive masks (only 0 and -inf) among the inputs.
        scale: the loss scale of the failing backward.
        recorded_loss: the loss the recorder saw (None if unknown).
        tried: per replayed precision, whether its run was finite (None: no runs to respect).
        scaler: whether the run had a GradScaler.
        mode: the precision mode (``autocast``, ``parameters``, ``fsdp_param_dtype``).
        low: the run's low precision (None for FP32).
        sdpa: the attention backends tried for an SDPA culprit (None otherwise).
        origins: per precision, where its first NaN/Inf came from (``_origin.Origin``).
        trace: the run the culprit was found in.
        context_ops: the ops around the culprit.
        literal / hidden / underflow_at: the op that wrote a literal -inf, the op whose NaN/Inf was
            hidden, the op where values flushed to zero (None where they do not apply).
        evidence: what the probes found around the verdict, by probe name (``probes/``: the
            magnitude jump of an overflow, the micro-batch of an accumulated step, the compiled
            re-run, ...); each value
            has ``to_dict()`` and maybe ``note()``. The summary and advice read it from here.
    """

    verdict: str
    culprit: Culprit | Mapping | None = None
    nonfinite_inputs: tuple[str, ...] = ()
    written_only: tuple[str, ...] = ()
    masks: tuple[str, ...] = ()
    scale: float = 1.0
    recorded_loss: float | None = None
    tried: Mapping[str, bool] | None = None
    scaler: bool = True
    mode: str = "autocast"
    low: str | None = None
    sdpa: SdpaCheck | None = None
    origins: Mapping[str, Any] = field(default_factory=dict, repr=False)
    trace: RunTrace | None = field(default=None, repr=False)
    context_ops: tuple[OpRecord, ...] = ()
    literal: OpRecord | None = None
    hidden: OpRecord | None = None
    underflow_at: OpRecord | None = None
    evidence: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class PrecisionRun(Mapping):
    """One precision's run of the step, as ``ReplayResult.runs`` holds it.

    A read-only mapping of its JSON fields (``run["finite"]``), in the ``--json`` order;
    ``finite_at_scale_1`` and ``emulated_cuda_fp32_calls`` are left out where they do not apply.
    """

    finite: bool
    loss: float
    loss_dtype: str
    forward_finite: bool
    backward_finite: bool
    grad_absmax: float | None
    scale: float
    ops: int
    first_nonfinite: dict | None
    finite_at_scale_1: Any = UNSET
    emulated_cuda_fp32_calls: Any = UNSET

    def _present(self) -> list[str]:
        return [k for k in self.__dataclass_fields__ if getattr(self, k) is not UNSET]

    def __getitem__(self, key: str) -> Any:
        if not isinstance(key, str) or key not in self._present():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self._present())

    def __len__(self) -> int:
        return len(self._present())

    def to_dict(self) -> dict:
        return dict(self.items())

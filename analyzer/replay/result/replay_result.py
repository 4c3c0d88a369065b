"""``ReplayResult``: the outcome of replaying one snapshot, and its strict-JSON form.

JSON never carries NaN/Infinity literals: a non-finite float becomes the string ``"nan"``,
``"inf"`` or ``"-inf"``. Everything else is a plain JSON value.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...findings import json_safe
from ..detection.backends import backend_of
from .diagnosis import Diagnosis, PrecisionRun
from .records import Culprit, OpRecord, headline
from ..verdicts.registry import VERDICTS, AdviceLine

if TYPE_CHECKING:
    from .trace import RunTrace

__all__ = ["ReplayResult", "VERDICTS"]


@dataclass
class ReplayResult:
    """What ``replay_snapshot`` found: a plain value (the rebuilt model stays with ``Replay``).

    It holds one ``Diagnosis`` (the verdict, the culprit, the step's facts and the probes' evidence),
    the summary and advice worded once from it, host-only summaries of the runs, and what the
    snapshot says; what the diagnosis holds is read from it (the properties below), never copied.

    Attributes:
        diagnosis: what the verdict, summary and advice were written from (its culprit trace without
            the captured tensors); its ``evidence`` holds what the probes found. An update replay's
            has the verdict, the culprit and the inputs only.
        summary: one plain sentence: what, where, why (``verdicts.summary`` of the diagnosis; an update
            replay's own sentence).
        runs: per precision, a ``PrecisionRun``: ``finite``, ``loss``, ``first_nonfinite`` and more.
        advice_lines: concrete things to try, most specific first: ``AdviceLine``s, each with the
            names of the fixes it recommends (``advice_with_status`` ties them to the fixes tried by
            these names). ``advice`` is their texts, as ``--json`` has them.
        traces: the raw per-precision ``RunTrace``s, without tensors (not serialised), for rendering and plots.
        precision_note: one line saying what the precision mode casts, and what it does not emulate.
        update: for an update snapshot (or one whose weights are already NaN/Inf beside its optimizer
            state), the forensics of the optimizer update (``analyzer.replay.update.forensics``): per parameter
            the factor that went non-finite, examples, the formula and hyperparameters. The forward
            and backward are not replayed then (``runs`` is empty). None for any other replay.

    Read from the diagnosis: ``verdict``, ``culprit``, ``scale``, ``recorded_loss``,
    ``nonfinite_inputs``, ``written_only_buffers``, ``mask_inputs``, ``hidden_nonfinite``,
    ``literal_nonfinite``, ``underflow_at``, ``context_ops``, ``culprit_trace``, ``precision_mode``,
    ``precision_dtype``, ``sdpa_backend``, ``backends``, ``compiled`` and ``evidence``.
    """

    diagnosis: Diagnosis
    summary: str
    runs: dict[str, PrecisionRun]
    snapshot: str
    step: int | None
    reason: str | None
    device: str
    recorded_device: str
    device_note: str | None
    amp_dtype: str | None
    traces: dict[str, RunTrace] = field(default_factory=dict, repr=False)
    precision_note: str | None = None
    update: dict | None = None  # update forensics (analyzer.replay.update.forensics); None for a forward/backward replay
    # reason "exception" (format 4): the exception the step raised (type, message, frames, step), else None
    exception: dict | None = None
    scaler_state: dict | None = field(default=None, repr=False)  # the snapshot's GradScaler state_dict, if any
    # A replay of a checkpoint and a batch (analyzer.load.adhoc), no recorder snapshot: the files read and
    # the defaults that stood in for what a snapshot records ({"checkpoint", "kind", "batch", "amp_dtype",
    # "scale", "seed", "logs", "notes": [...]}); None for a snapshot.
    checkpoint: dict | None = None
    advice_lines: tuple[AdviceLine, ...] = ()
    # A step that accumulated gradients (snapshot format 6): the snapshot's micro_batches entry (count,
    # combine, divisor, source, num_items_in_batch), every micro-batch replayed; None otherwise.
    micro_batches: dict | None = None
    # What loading the snapshot found implausible but usable (``Snapshot.load_notes``: a loss scale of 1e30,
    # integer weights beside float ones), printed before the verdict; in --json only when there are some.
    load_notes: tuple[str, ...] = ()

    @property
    def verdict(self) -> str:
        """A name in ``VERDICTS`` (the verdict registry, ``verdicts/registry.py``)."""
        return self.diagnosis.verdict

    @property
    def culprit(self) -> Culprit | None:
        """The origin op (``op``, ``module``, ``phase``, ``precision``, ``index``, ``source``,
        ``input_absmax``, ``output_absmax``, ``shadow``...) with the fields its probes' evidence spreads
        into it (``Probe.into == "culprit"``); None when healthy or no op is blamed."""
        c = self.diagnosis.culprit
        extra = self._spread("culprit")
        return dataclasses.replace(c, **extra) if extra and dataclasses.is_dataclass(c) else c

    @property
    def scale(self) -> float:
        """The loss scale of the failing backward."""
        return self.diagnosis.scale

    @property
    def recorded_loss(self) -> float | None:
        """The loss the recorder saw (None if unknown)."""
        return self.diagnosis.recorded_loss

    @property
    def nonfinite_inputs(self) -> list[str]:
        """Parameters, buffers and batch leaves the step reads that were already NaN/Inf
        (``param:fc.weight``, ``batch:x``)."""
        return list(self.diagnosis.nonfinite_inputs)

    @property
    def written_only_buffers(self) -> list[str]:
        """Buffers NaN/Inf in the snapshot that the step only writes (a train-mode BatchNorm's running
        stats in a snapshot taken after the forward): not inputs, so not a cause."""
        return list(self.diagnosis.written_only)

    @property
    def mask_inputs(self) -> list[str]:
        """Buffers and batch leaves holding only 0 and -inf: additive masks, whose -inf is written on
        purpose (like an in-step ``masked_fill(-inf)``), so not a cause."""
        return list(self.diagnosis.masks)

    @property
    def hidden_nonfinite(self) -> OpRecord | None:
        """The forward op whose NaN/Inf a later op hid (the loss stayed finite); None otherwise."""
        return self.diagnosis.hidden

    @property
    def literal_nonfinite(self) -> OpRecord | None:
        """The op that wrote a literal -inf (a mask value); None otherwise."""
        return self.diagnosis.literal

    @property
    def underflow_at(self) -> OpRecord | None:
        """The op where values flushed to zero; None otherwise."""
        return self.diagnosis.underflow_at

    @property
    def context_ops(self) -> list[OpRecord]:
        """The ops around the culprit."""
        return list(self.diagnosis.context_ops)

    @property
    def culprit_trace(self) -> RunTrace | None:
        """The run the culprit was found in, without tensors (None without a culprit's run)."""
        return self.diagnosis.trace

    @property
    def precision_mode(self) -> str:
        """How the low precision was replayed: ``autocast`` (FP32 parameters under torch.autocast),
        ``parameters`` (the parameters themselves are float16/bfloat16, no autocast) or
        ``fsdp_param_dtype`` (FSDP's MixedPrecisionPolicy param_dtype emulated)."""
        return self.diagnosis.mode

    @property
    def precision_dtype(self) -> str | None:
        """The low precision under test (autocast dtype, parameter dtype or param_dtype); None for FP32."""
        return self.diagnosis.low

    @property
    def sdpa_backend(self) -> str | None:
        """The scaled-dot-product-attention backend that ran (``math``, ``flash``, ``mem_efficient``,
        ``cudnn``; ``flash+math`` when calls differ): the culprit's call's when it is one, else that of
        the culprit's run (the trained precision's run without one); None when the step has no SDPA call."""
        sdpa = self.diagnosis.sdpa
        if sdpa is not None and sdpa.backend:
            return sdpa.backend
        runs = list(self.traces.values())
        trace = self.diagnosis.trace or (runs[min(1, len(runs) - 1)] if runs else None)
        return None if trace is None else backend_of(trace.sdpa_calls)

    @property
    def backends(self) -> dict[str, str] | None:
        """For an SDPA culprit, the step re-run in the same precision under each other backend:
        ``{backend: "finite" | "nonfinite at OP in `MODULE`" | "unavailable: why"}``; None otherwise.
        ``kernel_specific`` means one of them is finite."""
        sdpa = self.diagnosis.sdpa
        return None if sdpa is None else dict(sdpa.backends)

    @property
    def compiled(self) -> dict | None:
        """A snapshot of a torch.compile'd model: the step re-run compiled as training compiled it (the
        ``compiled`` probe's evidence; ``"reproduced": False`` with a one-line ``"note"`` when it could
        not be); None for an eager model."""
        ev = self.evidence.get("compiled")
        return None if ev is None else dict(ev.info)

    @property
    def advice(self) -> list[str]:
        """The advice's texts, most specific first (``advice_lines`` without the fixes they name)."""
        return [a.text for a in self.advice_lines]

    @property
    def evidence(self) -> Mapping[str, Any]:
        """What the probes found, by probe name (``Diagnosis.evidence``)."""
        return self.diagnosis.evidence

    def __post_init__(self):
        if not isinstance(self.diagnosis, Diagnosis):
            raise ValueError(f"diagnosis must be a Diagnosis, got {type(self.diagnosis).__name__}")
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {tuple(VERDICTS)}, got {self.verdict!r}")
        if not all(isinstance(a, AdviceLine) for a in self.advice_lines):
            raise ValueError("advice_lines must be AdviceLine values")
        if self.precision_mode not in ("autocast", "parameters", "fsdp_param_dtype"):
            raise ValueError(f"precision_mode must be autocast, parameters or fsdp_param_dtype, "
                             f"got {self.precision_mode!r}")

    def to_dict(self) -> dict:
        """The ``--json`` object (strict JSON: non-finite floats are strings)."""
        return json_safe({
            "format": "amp-autopsy.replay",
            "format_version": 1,
            "verdict": self.verdict,
            "summary": self.summary,
            "culprit": headline(self.culprit),  # the op the answer leads with (``records.headline``)
            "runs": self.runs,
            "advice": list(self.advice),
            "snapshot": self.snapshot,
            "step": self.step,
            "reason": self.reason,
            "device": self.device,
            "recorded_device": self.recorded_device,
            "device_note": self.device_note,
            "amp_dtype": self.amp_dtype,
            "scale": self.scale,
            "recorded_loss": self.recorded_loss,
            "nonfinite_inputs": self.nonfinite_inputs,
            "written_only_buffers": self.written_only_buffers,
            "mask_inputs": self.mask_inputs,
            "hidden_nonfinite": self.hidden_nonfinite,
            "literal_nonfinite": self.literal_nonfinite,
            "underflow_at": self.underflow_at,
            "context_ops": self.context_ops,
            "precision_mode": self.precision_mode,
            "precision_dtype": self.precision_dtype,
            "precision_note": self.precision_note,
            "sdpa_backend": self.sdpa_backend,
            "backends": self.backends,
            "update": self.update,
            "exception": self.exception,
            "checkpoint": self.checkpoint,
            "micro_batches": None if self.micro_batches is None else dict(self.micro_batches),
            "compiled": self.compiled,
            **({"load_notes": list(self.load_notes)} if self.load_notes else {}),
            **self._spread("result"),
        })

    def _spread(self, into: str) -> dict:
        """The fields the probes' evidence spreads `into` the culprit or the result (``Probe.into``), by the
        registry, in probe order (``fp8``'s ``fp8`` key, ``random_draws``' ``random_draws``...)."""
        if not self.evidence:
            return {}
        from ..probes.registry import spread

        return spread(self.evidence, into)

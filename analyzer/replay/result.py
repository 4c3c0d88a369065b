"""``ReplayResult``: the outcome of replaying one snapshot, and its strict-JSON form.

JSON never carries NaN/Infinity literals: a non-finite float becomes the string ``"nan"``,
``"inf"`` or ``"-inf"``. Everything else is a plain JSON value.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..findings import json_safe
from .diagnosis import Diagnosis, PrecisionRun
from .records import Culprit, OpRecord, headline
from .verdicts import VERDICTS, AdviceLine

if TYPE_CHECKING:
    from .trace import RunTrace

__all__ = ["ReplayResult", "VERDICTS"]


@dataclass
class ReplayResult:
    """What ``replay_snapshot`` found: a plain value (the rebuilt model stays with ``Replay``).

    Attributes:
        verdict: a name in ``VERDICTS`` (the verdict registry, ``verdicts.py``).
        summary: one plain sentence: what, where, why.
        culprit: the origin op (``op``, ``module``, ``phase``, ``precision``, ``index``,
            ``source``, ``input_absmax``, ``output_absmax``, ``shadow``...); None when healthy.
        runs: per precision, a ``PrecisionRun``: ``finite``, ``loss``, ``first_nonfinite`` and more.
        nonfinite_inputs: parameters, buffers and batch leaves the step reads that were already
            NaN/Inf (``param:fc.weight``, ``batch:x``).
        written_only_buffers: buffers NaN/Inf in the snapshot that the step only writes (a
            train-mode BatchNorm's running stats in a snapshot taken after the forward): not
            inputs, so not a cause.
        mask_inputs: buffers and batch leaves holding only 0 and -inf: additive masks, whose -inf
            is written on purpose (like an in-step ``masked_fill(-inf)``), so not a cause.
        advice_lines: concrete things to try, most specific first: ``AdviceLine``s, each with the
            names of the fixes it recommends (``advice_with_status`` ties them to the fixes tried by
            these names). ``advice`` is their texts, as ``--json`` has them.
        traces: the raw per-precision ``RunTrace``s (not serialised), for rendering and plots.
        precision_mode: how the low precision was replayed: ``autocast`` (FP32 parameters under
            torch.autocast), ``parameters`` (the parameters themselves are float16/bfloat16, no
            autocast) or ``fsdp_param_dtype`` (FSDP's MixedPrecisionPolicy param_dtype emulated).
        precision_dtype: the low precision under test (autocast dtype, parameter dtype or
            param_dtype); None for an FP32 run.
        precision_note: one line saying what the mode casts, and what it does not emulate.
        sdpa_backend: the scaled-dot-product-attention backend that ran (``math``, ``flash``,
            ``mem_efficient``, ``cudnn``; ``flash+math`` when calls differ), that of the culprit's
            call when it is one; None when the step has no SDPA call.
        backends: for an SDPA culprit, the step re-run in the same precision under each other
            backend: ``{backend: "finite" | "nonfinite at OP in `MODULE`" | "unavailable: why"}``;
            None otherwise. ``kernel_specific`` means one of them is finite.
        update: for an update snapshot (or one whose weights are already NaN/Inf beside its optimizer
            state), the forensics of the optimizer update (``analyzer.replay.update``): per parameter
            the factor that went non-finite, examples, the formula and hyperparameters. The forward
            and backward are not replayed then (``runs`` is empty). None for any other replay.
    """

    verdict: str
    summary: str
    culprit: Culprit | None
    runs: dict[str, PrecisionRun]
    snapshot: str
    step: int | None
    reason: str | None
    device: str
    recorded_device: str
    device_note: str | None
    amp_dtype: str | None
    scale: float
    recorded_loss: float | None
    nonfinite_inputs: list[str] = field(default_factory=list)
    written_only_buffers: list[str] = field(default_factory=list)
    mask_inputs: list[str] = field(default_factory=list)
    hidden_nonfinite: OpRecord | None = None
    literal_nonfinite: OpRecord | None = None
    underflow_at: OpRecord | None = None
    context_ops: list[OpRecord] = field(default_factory=list)
    traces: dict[str, RunTrace] = field(default_factory=dict, repr=False)
    culprit_trace: RunTrace | None = field(default=None, repr=False)
    precision_mode: str = "autocast"
    precision_dtype: str | None = None
    precision_note: str | None = None
    sdpa_backend: str | None = None
    backends: dict[str, str] | None = None
    update: dict | None = None  # update forensics (analyzer.replay.update); None for a forward/backward replay
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
    # A snapshot of a torch.compile'd model: the step re-run compiled as training compiled it
    # (analyzer.replay.compiled.replay; "reproduced": False with a one-line "note" when it could not be);
    # None for an eager model.
    compiled: dict | None = None
    # What loading the snapshot found implausible but usable (``Snapshot.load_notes``: a loss scale of 1e30,
    # integer weights beside float ones), printed before the verdict; in --json only when there are some.
    load_notes: tuple[str, ...] = ()
    # The diagnosis the verdict, summary and advice were written from (its culprit trace without the
    # captured tensors); its ``evidence`` holds what the probes found. None for an update replay.
    diagnosis: Diagnosis | None = field(default=None, repr=False)

    @property
    def advice(self) -> list[str]:
        """The advice's texts, most specific first (``advice_lines`` without the fixes they name)."""
        return [a.text for a in self.advice_lines]

    @property
    def evidence(self) -> Mapping[str, Any]:
        """What the probes found, by probe name (``Diagnosis.evidence``); empty without a diagnosis."""
        return {} if self.diagnosis is None else self.diagnosis.evidence

    def __post_init__(self):
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
            "nonfinite_inputs": list(self.nonfinite_inputs),
            "written_only_buffers": list(self.written_only_buffers),
            "mask_inputs": list(self.mask_inputs),
            "hidden_nonfinite": self.hidden_nonfinite,
            "literal_nonfinite": self.literal_nonfinite,
            "underflow_at": self.underflow_at,
            "context_ops": self.context_ops,
            "precision_mode": self.precision_mode,
            "precision_dtype": self.precision_dtype,
            "precision_note": self.precision_note,
            "sdpa_backend": self.sdpa_backend,
            "backends": None if self.backends is None else dict(self.backends),
            "update": self.update,
            "exception": self.exception,
            "checkpoint": self.checkpoint,
            "micro_batches": None if self.micro_batches is None else dict(self.micro_batches),
            "compiled": self.compiled,
            **({"load_notes": list(self.load_notes)} if self.load_notes else {}),
            **self._evidence_fields(),
        })

    def _evidence_fields(self) -> dict:
        """Top-level fields the probes' evidence spreads into (``Probe.into == "result"``), by the
        registry; of the built-in probes only ``fp8`` has one (its ``fp8`` key), the others' are the culprit's."""
        if not self.evidence:
            return {}
        from .probes.registry import spread

        return spread(self.evidence, "result")

"""What ``analyzer inspect`` returns: per-tensor and per-file reports, the A -> B changes, and
their ``--json`` form, bounded: at most ``JSON_TENSORS`` entries per list unless every one is asked for."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..findings import Finding, exit_status, json_safe
from ..load.checkpoint import Checkpoint
from ._stats import BF16_FLUSH, BF16_OVERFLOW, FP16_FLUSH, FP16_MAX, FP16_OVERFLOW, PairChange, TensorStats

__all__ = ["TensorReport", "FileReport", "TensorChange", "InspectResult", "JSON_TENSORS", "PRODUCT_HEADROOM",
           "UNDERFLOW_FRAC", "badness", "listed"]

PRODUCT_HEADROOM = 64.0   # fp16_range_risk flags abs_max * sqrt(fan_in) > 65504 / 64 (see _range_risk)
UNDERFLOW_FRAC = 0.01     # fp16_range_risk flags a weight when >= 1% of its values flush to zero in FP16
JSON_TENSORS = 500  # tensors (and changes) --json lists per file, worst first, unless asked for all
_CAST = ("weight", "input")  # roles autocast casts to FP16/BF16; optimizer state and buffers stay FP32


def badness(t: TensorReport) -> tuple:
    """Sort key, worst first: non-finite share, then for tensors that autocast casts (weights, inputs)
    the FP16 overflow share, flush-to-zero share and abs-max; optimizer state and buffers after."""
    s = t.stats
    if t.role not in _CAST:
        return (-s.frac(s.nonfinite), 0.0, 0.0, 1, 0.0)
    return (-s.frac(s.nonfinite), -s.frac(s.fp16_overflow), -s.frac(s.fp16_flush), 0, -(s.abs_max or 0.0))


def _worst(items: tuple, limit: int | None, key) -> list:
    """`items` if at most `limit` (None: no limit), else the `limit` worst by `key`, in their own order."""
    if limit is None or len(items) <= limit:
        return list(items)
    keep = set(sorted(range(len(items)), key=lambda i: key(items[i]))[:limit])
    return [x for i, x in enumerate(items) if i in keep]


def listed(out: dict, key: str, shown: list, total: int) -> dict:
    """`out` with `key` listing `shown` and, when some were left out, ``<key>_total`` and ``<key>_omitted``."""
    out[key] = shown
    if len(shown) < total:
        out[f"{key}_total"], out[f"{key}_omitted"] = total, total - len(shown)
    return out


@dataclass(frozen=True)
class TensorReport:
    """One scanned tensor: where it sits, what it is, and its statistics."""

    name: str
    role: str
    shape: tuple[int, ...]
    dtype: str
    stats: TensorStats
    param: str | None = None
    slot: str | None = None

    def to_dict(self) -> dict[str, Any]:
        s = self.stats
        return {
            "name": self.name, "role": self.role, "param": self.param, "slot": self.slot,
            "shape": list(self.shape), "dtype": self.dtype, "numel": s.numel,
            "nonfinite": s.nonfinite, "nan": s.nan, "inf": s.inf, "zeros": s.zeros,
            "abs_max": s.abs_max, "min_nonzero_abs": s.min_nonzero,
            "fp16_overflow": s.fp16_overflow, "fp16_overflow_frac": s.frac(s.fp16_overflow),
            "fp16_flush": s.fp16_flush, "fp16_flush_frac": s.frac(s.fp16_flush),
            "bf16_overflow": s.bf16_overflow, "bf16_flush": s.bf16_flush, "bf16_flush_frac": s.frac(s.bf16_flush),
        }


@dataclass(frozen=True)
class FileReport:
    """What one checkpoint file holds: its layout and every floating-point tensor's statistics."""

    ckpt: Checkpoint
    tensors: tuple[TensorReport, ...]

    @property
    def label(self) -> str:
        return Path(self.ckpt.path).name

    def to_dict(self, tensors: int | None = None) -> dict[str, Any]:
        """`tensors`: list at most that many, the worst (``tensors_total``/``tensors_omitted`` then say
        how many were left out); None lists every one."""
        c = self.ckpt
        shown = [t.to_dict() for t in _worst(self.tensors, tensors, badness)]
        return listed({
            "path": c.path, "format": c.format, "layout": c.layout, "bytes": c.nbytes,
            "step": c.step, "step_key": c.step_key, "models": c.model_paths,
            "optimizers": [{"path": o.path, "params": o.n_params, "mapping": o.mapping, "guess": o.mapping == "order",
                            "note": o.note, "stateless": list(o.stateless)} for o in c.optimizers],
            "scaler": c.scaler, "metadata": c.metadata, "non_floating_tensors": c.non_floating, "notes": list(c.notes),
        }, "tensors", shown, len(self.tensors))


@dataclass(frozen=True)
class TensorChange:
    """How one tensor moved from checkpoint A to B."""

    name: str
    role: str
    change: PairChange
    became_nonfinite: bool

    def to_dict(self) -> dict[str, Any]:
        c = self.change
        return {"name": self.name, "role": self.role, "rel_change": c.rel_change, "changed": c.changed,
                "numel": c.numel, "stalled": c.stalled, "became_nonfinite": self.became_nonfinite}


@dataclass(frozen=True)
class InspectResult:
    """Everything ``analyzer inspect`` found. ``files[1]`` and ``changes`` exist only for a pair."""

    files: tuple[FileReport, ...]
    findings: tuple[Finding, ...]
    changes: tuple[TensorChange, ...] | None = None
    only_in_a: tuple[str, ...] = ()
    only_in_b: tuple[str, ...] = ()

    def exit_status(self, fail_on: str | None = None) -> int:
        """The CLI's exit status: EXIT_FAIL_ON when a finding of severity `fail_on` ("error" or
        "warning") or worse is present, else 0 (also when `fail_on` is None)."""
        return exit_status(self.findings, fail_on)

    def to_dict(self, tensors: int | None = JSON_TENSORS) -> dict[str, Any]:
        """Strict JSON: non-finite floats become "nan"/"inf" strings (``findings.json_safe``).

        `tensors`: each file's ``tensors`` and the diff's lists hold at most that many entries (the
        worst tensors, the largest changes; ``<list>_total`` and ``<list>_omitted`` count the rest), so
        a file of 300,000 tensors gives kilobytes, not hundreds of megabytes; None lists every one.
        """
        diff = None
        if self.changes is not None:
            diff = {"a": self.files[0].ckpt.path, "b": self.files[1].ckpt.path}
            changes = _worst(self.changes, tensors, lambda c: (not c.became_nonfinite, -(c.change.rel_change or 0.0)))
            listed(diff, "changes", [c.to_dict() for c in changes], len(self.changes))
            for key, names in (("became_nonfinite", [c.name for c in self.changes if c.became_nonfinite]),
                               ("stalled", [c.name for c in self.changes if c.change.stalled]),
                               ("only_in_a", list(self.only_in_a)), ("only_in_b", list(self.only_in_b))):
                listed(diff, key, names if tensors is None else names[:tensors], len(names))
        return json_safe({
            "files": [f.to_dict(tensors) for f in self.files],
            "findings": [f.to_dict() for f in self.findings],
            "diff": diff,
            "thresholds": {"fp16_max": FP16_MAX, "fp16_overflow_at": FP16_OVERFLOW,
                           "fp16_flush_at_or_below": FP16_FLUSH, "bf16_overflow_at": BF16_OVERFLOW,
                           "bf16_flush_at_or_below": BF16_FLUSH, "product_headroom": PRODUCT_HEADROOM,
                           "underflow_frac": UNDERFLOW_FRAC},
        })

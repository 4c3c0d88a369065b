"""``analyzer report``: build a ``Report`` (findings on a run's trace); ``analyzer.render`` draws it as text, PNG, HTML.

``build_report`` opens the run lazily (``analyzer.load``), aggregates it with streaming polars
queries (``analyzer.report.checks.frames``), runs every registered check and returns a ``Report``.

Real output (an FP16 run whose attention logits overflow)::

    amp-autopsy report: attn-fp16 (amp-autopsy run, float16 AMP, 1 rank(s), steps 0..49, 50 steps)
    Verdict: FAILED: the loss scale fell from 65536 to 1 in 16 backoffs by step 23, then to 1.49e-08,
    and never recovered (scale_collapse, step 1); 2 error(s), 0 warning(s)

    errors
      scale_collapse @ step 1: the loss scale fell from 65536 to 1 in 16 backoffs by step 23, ...
          evidence: step_start=1 scale_start=6.554e+04 step_reached=23 scale_reached=1 ...
      nonfinite_loss @ step 13: the loss became nan at step 13 (37 non-finite step(s) of 50): the
      scaler was backing off before it (6 skipped step(s) in the previous 13, scale falling): FP16
      overflow; see scale_collapse / frequent_overflow, and replay it: analyzer replay
      attn-fp16/snapshots/step00000013-r00000-nonfinite_loss.pt

How to read it: the verdict names the earliest error; findings follow by severity, each with
the numbers behind it. ``--json`` carries the same findings with stable ``check`` names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from .checks import CHECK_FAILED, CHECKS, Frames, build_frames, run_checks
from .checks.gradients import stalled_fraction
from ..errors import BadInputError
from ..load import load_run
from ..findings import EXIT_FAIL_ON, Finding, exit_status, json_safe, sort_findings

__all__ = ["Report", "build_report", "EXIT_CHECK_FAILED", "EXIT_FAIL_ON"]

EXIT_CHECK_FAILED = 3  # a check raised (check_failed): the report is incomplete, an internal error


@dataclass
class Report:
    """The result of ``build_report``: findings plus the aggregates the plots need."""

    run: str
    source_format: str
    frames: Frames
    findings: list[Finding]
    notes: list[str] = field(default_factory=list)
    partial: bool = False
    rank: int | None = None
    steps_range: tuple[int | None, int | None] | None = None

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def failed_checks(self) -> list[str]:
        """Names of the checks that raised (each became a ``check_failed`` finding)."""
        return [str(f.evidence.get("check")) for f in self.findings if f.check == CHECK_FAILED]

    def exit_status(self, fail_on: str | None = None) -> int:
        """The CLI's exit status: EXIT_CHECK_FAILED when a check raised, else EXIT_FAIL_ON when a
        finding of severity `fail_on` ("error" or "warning") or worse is present, else 0."""
        if self.failed_checks:
            return EXIT_CHECK_FAILED
        return exit_status(self.findings, fail_on)

    def usable_values(self) -> dict[str, int]:
        """Non-null values per quantity the checks read (NaN and Inf count: they are diagnosed)."""
        s = self.frames.steps
        lb = self.frames.layer_bins
        out = {c: int(s[c].is_not_null().sum()) for c in ("loss", "grad_norm", "scale")}
        out["layer_grad_norm"] = int(lb["n_grad"].sum()) if lb is not None else 0
        return out

    @property
    def stalled_fraction(self) -> pl.DataFrame:
        """Per step, the fraction of parameters (by element count) whose gradient is stalled
        (columns ``step``, ``frac``): the series the ``stalled_layers`` check reads, for plots.
        Needs the layer table (``frames.layer_bins`` not None)."""
        return stalled_fraction(self.frames)

    def steps_summary(self) -> dict[str, Any]:
        s = self.frames.steps
        if s.height == 0:
            return {"count": 0}
        loss = s["loss"]
        scale = s["scale"].drop_nulls()
        return {"count": s.height, "first": int(s["step"][0]), "last": int(s["step"][-1]),
                "skipped": int(s["skipped"].fill_null(False).sum()),
                "nonfinite_loss": int((loss.is_not_null() & ~loss.is_finite()).sum()),
                "amp_dtype": self.frames.amp_dtype,
                "final_scale": float(scale[-1]) if scale.len() else None,
                "min_scale": float(scale.min()) if scale.len() else None,
                "last_finite_loss": _last_finite(loss), "range": list(self.steps_range or (None, None)),
                "usable_values": self.usable_values(), **self._scaled_loss_summary()}

    def _scaled_loss_summary(self) -> dict[str, Any]:
        """When ``scaled_loss`` found the trace holds loss x scale: ``loss_scaled`` and the last finite
        recorded value divided by its step's scale (the scale its ``scaler.scale(loss)`` multiplied by)."""
        if not any(f.check == "scaled_loss" for f in self.findings):
            return {"loss_scaled": False}
        s = self.frames.steps.filter(pl.col("loss").is_finite() & pl.col("scale").is_finite() & (pl.col("scale") > 0))
        return {"loss_scaled": True,
                "last_finite_loss_unscaled": float(s["loss"][-1] / s["scale"][-1]) if s.height else None}

    @property
    def verdict(self) -> str:
        n = self.frames.steps.height
        bad = [f for f in self.errors if f.check != CHECK_FAILED] or self.warnings
        if not bad and self.failed_checks:
            return (f"INCOMPLETE: {len(self.failed_checks)} check(s) failed ({', '.join(self.failed_checks)}; "
                    f"check_failed), no other errors or warnings over {n} steps")
        if not bad and not any(self.usable_values().values()):
            return (f"no usable values: the {n} recorded step(s) hold no loss, gradient norm, loss scale or "
                    "per-layer gradient norm (all null), so nothing can be diagnosed and nothing is known "
                    "to be healthy; pass the loss to end_step and check the recorder's warnings")
        if not bad:
            return f"healthy: no errors or warnings over {n} steps"
        f = bad[0]
        head = "FAILED" if f.severity == "error" else "SUSPECT"
        at = f", step {f.step}" if f.step is not None else ""
        return (f"{head}: {_first_clause(f.message)} ({f.check}{at}); "
                f"{len(self.errors)} error(s), {len(self.warnings)} warning(s)")

    def to_dict(self) -> dict[str, Any]:
        """One strict-JSON object: run, steps, findings, snapshots, ranks, verdict, partial."""
        return json_safe({
            "run": self.run, "source_format": self.source_format, "rank": self.rank,
            "verdict": self.verdict, "partial": self.partial, "notes": self.notes,
            "steps": self.steps_summary(),
            "findings": [f.to_dict() for f in self.findings],
            "snapshots": [s.to_dict() for s in self.frames.snapshots],
            "ranks": self.frames.ranks.to_dicts(),
            "checks": list(CHECKS),
        })


def _last_finite(s: pl.Series) -> float | None:
    f = s.filter(s.is_finite())
    return float(f[-1]) if f.len() else None


def _first_clause(msg: str, limit: int = 160) -> str:
    for sep in (": ", "; ", " ("):
        msg = msg.split(sep, 1)[0]
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def build_report(run, *, rank: int | None = None, steps=None, progress: bool = False,
                 plots: bool = True) -> Report:
    """Open `run` (directory or foreign log), aggregate it and run every check.

    Args:
        run: a run directory, a ``meta.json``, or a log file from another tool.
        rank: only this rank (default: all ranks merged, with ``rank_divergence``).
        steps: ``(a, b)`` for steps ``a <= step < b``; either end may be None.
        progress: print what is being read to stderr.
        plots: also aggregate what only the plots read (``analyzer.render``); False when the report
            is printed as text or JSON only. The findings are the same either way.

    Raises:
        analyzer.errors.BadInputError: missing, empty, damaged or foreign input.
        analyzer.errors.VersionError: written by a newer amp-autopsy.

    Example:
        >>> rep = build_report("runs/attn-fp16")                 # doctest: +SKIP
        >>> [f.check for f in rep.findings]                      # doctest: +SKIP
        ['scale_collapse', 'nonfinite_loss']
    """
    r = load_run(run, progress=progress)
    frames = build_frames(r, rank=rank, steps=steps, progress=progress, plots=plots)
    if frames.steps.height == 0:
        what = f"rank {rank}" if rank is not None else "the run"
        if rank is not None and rank not in frames.ranks["rank"].to_list():
            raise BadInputError(f"no rank {rank} in this run (ranks: {frames.ranks['rank'].to_list()})",
                                path=r.path, fix="pass one of the run's ranks to --rank")
        if steps is None:  # zero-row parts: there is no range to widen
            raise BadInputError(f"the trace holds no step rows for {what} (its parts are empty)", path=r.path,
                                fix="record at least one complete step; parts with zero rows carry nothing")
        raise BadInputError(f"no steps of {what} in the range {steps}", path=r.path,
                            fix="widen --steps A:B (A included, B excluded)")
    findings = sort_findings(run_checks(frames))
    return Report(run=str(run), source_format=r.source_format, frames=frames, findings=findings,
                  notes=list(r.notes) + frames.notes, partial=r.partial, rank=rank, steps_range=steps)

"""``analyzer report``: findings on a run's trace, rendered as text, JSON, PNG plots and HTML.

``build_report`` opens the run lazily (``analyzer.runs``), aggregates it with streaming polars
queries (``analyzer.checks.frames``), runs every registered check and returns a ``Report``.

Real output (an FP16 run whose attention logits overflow)::

    amp-autopsy report: attn-fp16 (amp-autopsy run, float16 AMP, 1 rank(s), steps 0..49, 50 steps)
    Verdict: FAILED: the loss scale fell from 65536 to 1.49e-08 in 16 backoffs and never recovered
    (scale_collapse, step 1); 2 error(s), 0 warning(s)

    errors
      scale_collapse @ step 1: the loss scale fell from 65536 to 1.49e-08 in 16 backoffs ...
          evidence: step_start=1 scale_start=6.554e+04 step_reached=23 scale_reached=1 ...
      nonfinite_loss @ step 13: the loss became nan at step 13 (37 non-finite step(s) of 50): the
      scaler was backing off before it (6 skipped step(s) in the previous 13, scale falling): FP16
      overflow; see scale_collapse / frequent_overflow, and replay it: analyzer replay
      attn-fp16/snapshots/step00000013-r00000-nonfinite_loss.pt

How to read it: the verdict names the earliest error; findings follow by severity, each with
the numbers behind it. ``--json`` carries the same findings with stable ``check`` names.
"""
from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from ._outputs import atomic_write_bytes, atomic_write_text
from .checks import CHECK_FAILED, CHECKS, Frames, build_frames, run_checks
from .errors import BadInputError
from .findings import Finding, json_safe, sort_findings
from .runs import load_run

__all__ = ["Report", "build_report", "render_report_text", "write_plots", "write_html",
           "EXIT_CHECK_FAILED", "EXIT_FAIL_ON"]

_MAX_LISTED = 16  # ranks and snapshots listed in the text report
EXIT_CHECK_FAILED = 3  # a check raised (check_failed): the report is incomplete, an internal error
EXIT_FAIL_ON = 4       # --fail-on SEVERITY: a finding that severe or worse is present


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
        gate = {"error": ("error",), "warning": ("error", "warning")}.get(fail_on or "", ())
        return EXIT_FAIL_ON if any(f.severity in gate for f in self.findings) else 0

    def usable_values(self) -> dict[str, int]:
        """Non-null values per quantity the checks read (NaN and Inf count: they are diagnosed)."""
        s = self.frames.steps
        lb = self.frames.layer_bins
        out = {c: int(s[c].is_not_null().sum()) for c in ("loss", "grad_norm", "scale")}
        out["layer_grad_norm"] = int(lb["n_grad"].sum()) if lb is not None else 0
        return out

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
                "usable_values": self.usable_values()}

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
            "snapshots": self.frames.snapshots,
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


def build_report(run, *, rank: int | None = None, steps=None, progress: bool = False) -> Report:
    """Open `run` (directory or foreign log), aggregate it and run every check.

    Args:
        run: a run directory, a ``meta.json``, or a log file from another tool.
        rank: only this rank (default: all ranks merged, with ``rank_divergence``).
        steps: ``(a, b)`` for steps ``a <= step < b``; either end may be None.
        progress: print what is being read to stderr.

    Raises:
        analyzer.errors.BadInputError: missing, empty, damaged or foreign input.
        analyzer.errors.VersionError: written by a newer amp-autopsy.

    Example:
        >>> rep = build_report("runs/attn-fp16")                 # doctest: +SKIP
        >>> [f.check for f in rep.findings]                      # doctest: +SKIP
        ['scale_collapse', 'nonfinite_loss']
    """
    r = load_run(run, progress=progress)
    frames = build_frames(r, rank=rank, steps=steps, progress=progress)
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


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    if isinstance(v, dict):
        items = list(v.items())
        text = ", ".join(f"{k}: {_fmt(x)}" for k, x in items[:6])
        return "{" + text + (", ..." if len(items) > 6 else "") + "}"
    if isinstance(v, (list, tuple)):
        text = ", ".join(_fmt(x) for x in v[:6])
        return "[" + text + (", ..." if len(v) > 6 else "") + "]"
    return str(v)


def _evidence_line(f: Finding) -> str:
    skip = {"profile", "first_nonfinite_step_per_rank"}
    return " ".join(f"{k}={_fmt(v)}" for k, v in f.evidence.items() if k not in skip and v is not None)


def render_report_text(rep: Report) -> str:
    """Short verdict first, then findings by severity with their evidence numbers."""
    s = rep.steps_summary()
    fr = rep.frames
    kind = "amp-autopsy run" if rep.source_format == "amp-autopsy" else f"{rep.source_format} import"
    who = f"rank {rep.rank} of {fr.n_ranks}" if rep.rank is not None else f"{fr.n_ranks} rank(s)"
    lines = [f"amp-autopsy report: {rep.run} ({kind}, {fr.amp_dtype or 'fp32/unknown'} AMP, {who}, "
             f"steps {s.get('first')}..{s.get('last')}, {s.get('count')} steps)",
             f"Verdict: {rep.verdict}"]
    if rep.partial or rep.notes:
        lines.append("")
        lines += [f"note: {n}" for n in rep.notes]
    for sev, title in (("error", "errors"), ("warning", "warnings"), ("info", "info")):
        group = [f for f in rep.findings if f.severity == sev]
        if not group:
            continue
        lines += ["", title]
        for f in group:
            at = f" @ step {f.step}" if f.step is not None else ""
            on = f" (rank {f.rank})" if f.rank is not None and fr.n_ranks > 1 else ""
            lines.append(f"  {f.check}{at}{on}: {f.message}")
            ev = _evidence_line(f)
            if ev:
                lines.append(f"      evidence: {ev}")
    lines += ["", f"steps: {s.get('count')} recorded, {s.get('skipped')} skipped, "
              f"{s.get('nonfinite_loss')} non-finite loss, last finite loss {_fmt(s.get('last_finite_loss'))}, "
              f"final scale {_fmt(s.get('final_scale'))}"]
    if fr.n_ranks > 1:
        lines.append("ranks:")
        for row in fr.ranks.head(_MAX_LISTED).iter_rows(named=True):
            nf = row["first_nonfinite_step"]
            lines.append(f"  rank {row['rank']}: steps {row['first_step']}..{row['last_step']}, "
                         f"{row['n_skipped']} skipped, first non-finite loss "
                         f"{'at step ' + str(nf) if nf is not None else 'never'}, final scale {_fmt(row['final_scale'])}")
        if fr.n_ranks > _MAX_LISTED:
            lines.append(f"  ... and {fr.n_ranks - _MAX_LISTED} more (--json lists every rank)")
    if fr.snapshots:
        lines.append("snapshots (replay with: analyzer replay FILE):")
        lines += [f"  {sn['file']} (step {sn['step']}, rank {sn['rank']}, {sn['reason']})"
                  for sn in fr.snapshots[:_MAX_LISTED]]
        if len(fr.snapshots) > _MAX_LISTED:
            lines.append(f"  ... and {len(fr.snapshots) - _MAX_LISTED} more (--json lists every snapshot)")
    return "\n".join(lines)


def _figures(rep: Report):
    from . import plots

    fr = rep.frames
    name = Path(rep.run).name or rep.run
    yield "loss_scale", lambda: plots.plot_loss_scale(fr, name)
    if fr.layer_bins is not None:
        yield "grad_heatmap", lambda: plots.plot_grad_heatmap(fr, name)
        yield "stalled_fraction", lambda: plots.plot_stalled_fraction(fr, name)
        yield "grad_vs_depth", lambda: plots.plot_grad_vs_depth(fr, name)


def write_plots(rep: Report, out_dir) -> list[Path]:
    """Write the report's PNGs into `out_dir` (created) and return their paths."""
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for stem, make in _figures(rep):
        fig = make()
        try:
            path = out / f"{stem}.png"
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=110)
            paths.append(atomic_write_bytes(path, buf.getvalue()))  # never a half-written PNG
        finally:
            plt.close(fig)
    return paths


def _png_b64(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return base64.b64encode(buf.getvalue()).decode()


_CSS = """body{font:14px/1.45 system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.4em}.verdict{font-size:1.15em;padding:.6em .8em;border-radius:6px;background:#eef}
.error{color:#b00020}.warning{color:#a66300}.info{color:#555}table{border-collapse:collapse;width:100%}
td,th{border-bottom:1px solid #ddd;padding:.35em .5em;text-align:left;vertical-align:top}
code{font-size:12px;color:#333;word-break:break-all}img{max-width:100%;margin:1em 0}"""


def write_html(rep: Report, path) -> Path:
    """Write one self-contained HTML page (plots embedded as base64 PNG) and return its path."""
    import matplotlib.pyplot as plt

    e = html.escape
    s = rep.steps_summary()
    rows = []
    for f in rep.findings:
        rows.append(f"<tr><td class='{f.severity}'>{f.severity}</td><td><b>{e(f.check)}</b></td>"
                    f"<td>{'' if f.step is None else f.step}</td><td>{e(f.message)}"
                    f"<br><code>{e(_evidence_line(f))}</code></td></tr>")
    imgs = []
    for stem, make in _figures(rep):
        fig = make()
        try:
            imgs.append(f"<h3>{e(stem.replace('_', ' '))}</h3><img alt='{stem}' src='data:image/png;base64,"
                        f"{_png_b64(fig)}'>")
        finally:
            plt.close(fig)
    snaps = "".join(f"<li><a href='{e(Path(sn['file']).resolve().as_uri())}'>{e(Path(sn['file']).name)}</a> "
                    f"(step {sn['step']}, rank {sn['rank']}, {e(str(sn['reason']))}): "
                    f"<code>analyzer replay {e(sn['file'])}</code></li>" for sn in rep.frames.snapshots)
    notes = "".join(f"<li>{e(n)}</li>" for n in rep.notes)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>amp-autopsy report: {e(rep.run)}</title>
<style>{_CSS}</style></head><body>
<h1>amp-autopsy report: {e(rep.run)}</h1>
<p class="verdict">{e(rep.verdict)}</p>
<p>{e(rep.source_format)}, AMP {e(str(rep.frames.amp_dtype))}, {rep.frames.n_ranks} rank(s),
steps {s.get('first')}..{s.get('last')} ({s.get('count')} steps, {s.get('skipped')} skipped,
{s.get('nonfinite_loss')} non-finite losses)</p>
{f'<ul>{notes}</ul>' if notes else ''}
<h2>Findings</h2>
{'<table><tr><th>severity</th><th>check</th><th>step</th><th>message and evidence</th></tr>'
 + ''.join(rows) + '</table>' if rows else '<p>No findings.</p>'}
<h2>Snapshots</h2>{f'<ul>{snaps}</ul>' if snaps else '<p>No snapshots.</p>'}
<h2>Plots</h2>{''.join(imgs)}
</body></html>"""
    return atomic_write_text(path, page)  # a crash leaves the old file or the new one

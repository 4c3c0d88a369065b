"""Render a ``Report``: the text report, the PNG plots and the self-contained HTML page."""
from __future__ import annotations

import html
import io
import math
import os
import urllib.parse
from pathlib import Path
from typing import Any

from ..report import Finding, Report
from ..report import autocast_was_inactive
from .outputs import atomic_write_bytes, atomic_write_text

__all__ = ["FIGURE_CAPTIONS", "relative_href", "render_report_text", "write_html", "write_plots"]

_MAX_LISTED = 16  # ranks and snapshots listed in the text report


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


def _precision(fr) -> str:
    """``float16 AMP``; ``float16 parameters, no AMP`` for a pure low-precision run (meta's params); then the
    FP8 matmuls of a torchao FP8 run (meta's ``fp8_recipe``)."""
    if autocast_was_inactive(getattr(fr, "meta", None)):
        return "autocast was not active during the forward: this run trained in FP32"
    meta = fr.meta if isinstance(getattr(fr, "meta", None), dict) else {}
    fp8 = _fp8(meta.get("fp8_recipe"))
    if fr.amp_dtype:
        return f"{fr.amp_dtype} AMP{fp8}"
    params = meta.get("params")
    low = sorted({p.get("dtype") for p in params or () if isinstance(p, dict)} & {"float16", "bfloat16"})
    if low:
        return f"{'/'.join(low)} parameters, no AMP{fp8}"
    return f"fp32 (no AMP){fp8}" if fp8 else "fp32/unknown AMP"


def _fp8(recipe) -> str:
    """``, FP8 matmuls in 6 modules (tensorwise)`` from a recipe entry (``recorders.fp8_recipe``), else ``""``."""
    if not isinstance(recipe, dict) or not isinstance(recipe.get("modules"), dict) or not recipe["modules"]:
        return ""
    configs = recipe.get("configs") if isinstance(recipe.get("configs"), list) else []
    grans = sorted({r["granularity"] for c in configs if isinstance(c, dict) and isinstance(c.get("roles"), dict)
                    for r in c["roles"].values() if isinstance(r, dict) and isinstance(r.get("granularity"), str)})
    how = f" ({'/'.join(grans)[:80]})" if grans else ""
    return f", FP8 matmuls in {len(recipe['modules'])} module(s){how}"


def render_report_text(rep: Report) -> str:
    """Short verdict first, then findings by severity with their evidence numbers."""
    s = rep.steps_summary()
    fr = rep.frames
    kind = "amp-autopsy run" if rep.source_format == "amp-autopsy" else f"{rep.source_format} import"
    who = f"rank {rep.rank} of {fr.n_ranks}" if rep.rank is not None else f"{fr.n_ranks} rank(s)"
    lines = [f"amp-autopsy report: {rep.run} ({kind}, {_precision(fr)}, {who}, "
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
    last = f"last finite loss {_fmt(s.get('last_finite_loss'))}"
    if s.get("loss_scaled"):  # the trace holds loss x scale (scaled_loss): never print it as the loss
        last = (f"last finite loss {_fmt(s.get('last_finite_loss_unscaled'))} (recorded "
                f"{_fmt(s.get('last_finite_loss'))} = loss x scale: scaled_loss)")
    lines += ["", f"steps: {s.get('count')} recorded, {s.get('skipped')} skipped, "
              f"{s.get('nonfinite_loss')} non-finite loss, {last}, final scale {_fmt(s.get('final_scale'))}"]
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
        lines += [f"  {sn.file} (step {sn.step}, rank {sn.rank}, {sn.reason})"
                  for sn in fr.snapshots[:_MAX_LISTED]]
        if len(fr.snapshots) > _MAX_LISTED:
            lines.append(f"  ... and {len(fr.snapshots) - _MAX_LISTED} more (--json lists every snapshot)")
    return "\n".join(lines)


# One line per figure on how to read it (the HTML pages print it under the figure).
FIGURE_CAPTIONS = {
    "loss_scale": "Loss per step (top; the line breaks where the loss is NaN/Inf, red crosses mark those steps, "
                  "orange ticks skipped steps) and the loss scale (bottom, log2): a scale sliding towards 1 "
                  "means the scaler keeps finding overflows.",
    "grad_heatmap": "log10 gradient norm per parameter (rows, input at top) over steps: red cells are NaN/Inf "
                    "(overflow), black ones exactly zero (the colour bar's two ends), white ones have no gradient "
                    "recorded; a dark band is a layer whose gradient vanished.",
    "stalled_fraction": "Share of the parameters (by element count) whose gradient is stalled, per step: a curve "
                        "that rises and stays up means parts of the model stopped learning.",
    "grad_vs_depth": "Gradient norm against depth at a few steps: a slope falling towards the input is vanishing "
                     "gradients; a gap is a non-finite or missing norm, triangles at the bottom exact zeros "
                     "(the legend names each one's step).",
}


def relative_href(target, page) -> str:
    """The URL of file `target` relative to the directory of the HTML file `page`.

    A relative link keeps working when the page and the run directory are moved or shared
    together; the absolute ``file:///`` links it replaces broke as soon as they were. Falls
    back to an absolute file URL only where no relative path exists (another drive on Windows).
    """
    t = Path(target).resolve()
    try:
        rel = os.path.relpath(t, Path(page).resolve().parent)
    except ValueError:
        return t.as_uri()
    return urllib.parse.quote(Path(rel).as_posix())


def _figures(rep: Report):
    from . import heatmap, plots

    fr = rep.frames
    name = Path(rep.run).name or rep.run
    yield "loss_scale", lambda: plots.plot_loss_scale(fr, name)
    if fr.layer_bins is not None:
        yield "grad_heatmap", lambda: heatmap.plot_grad_heatmap(fr, name)
        yield "stalled_fraction", lambda: plots.plot_stalled_fraction(fr, rep.stalled_fraction, name)
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
    from .png import figure_png_b64

    return figure_png_b64(fig, dpi=100)  # a palette PNG: a third of the bytes, the same picture


_CSS = """body{font:14px/1.45 system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.4em}.verdict{font-size:1.15em;padding:.6em .8em;border-radius:6px;background:#eef}
.error{color:#b00020}.warning{color:#a66300}.info{color:#555}table{border-collapse:collapse;width:100%}
td,th{border-bottom:1px solid #ddd;padding:.35em .5em;text-align:left;vertical-align:top}
code{font-size:12px;color:#333;word-break:break-all}img{max-width:100%;margin:1em 0}"""


def write_html(rep: Report, path) -> Path:
    """Write one self-contained HTML page (plots embedded as base64 PNG) and return its path.

    Snapshot links are relative to the page (``relative_href``): moved together with the run
    directory, or attached next to it, the page still opens its snapshots.
    """
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
            imgs.append(f"<h3>{e(stem.replace('_', ' '))}</h3><p>{e(FIGURE_CAPTIONS[stem])}</p>"
                        f"<img alt='{stem}' src='data:image/png;base64,{_png_b64(fig)}'>")
        finally:
            plt.close(fig)
    snaps = "".join(f"<li><a href='{e(relative_href(sn.file, path))}'>{e(Path(sn.file).name)}</a> "
                    f"(step {sn.step}, rank {sn.rank}, {e(str(sn.reason))}): "
                    f"<code>analyzer replay {e(sn.file)}</code></li>" for sn in rep.frames.snapshots)
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

"""The autopsy page: one self-contained HTML file that answers first, then shows the evidence.

The HTML report was the file a bug report attaches, yet it had no culprit, no fixes and no
replay figure, and its snapshot links were absolute ``file:///`` paths that broke once the file
was shared. This page, written by ``analyzer autopsy --html FILE``, is in reading order:

1. the verdict box: verdict, one sentence, step, rank, precision;
2. the culprit table: op, module, source line, phase, precision, step, rank, snapshot;
3. the fixes tried on the failing step, one list per distinct culprit, by status: *verified*
   first, then those finite but far from the FP32 step (*changes the result*), then those that
   were tried and still fail (shown as "does not help", never as a recommendation), then those
   not tried and why; advice that could not be tried is marked *untested*;
4. the replay figure of each distinct culprit (culprit marked, forward/backward boundary, a
   zoom on the ops around the culprit);
5. the report's findings as sentences, their raw evidence folded away (``<details>``);
6. the report's plots, each with one line on how to read it; then the snapshots.

Images are inlined as base64 PNG and nothing is fetched, so the page is one file. Snapshot links
are relative to the page's directory, so the page keeps working when it is moved together with
the run directory. Every string read from a file is escaped. Source lines are as the replay
shows them, relative to the run's recorded working directory (the absolute path is the cell's
tooltip), so the page reads the same whoever rendered it from wherever.

The page is meant to be attached: one replay figure per distinct culprit (a later snapshot that
blames the same op is one line under the first one's figure), figures as palette PNGs at 90 dpi.

Example:
    >>> write_autopsy_html("autopsy.html", result.to_dict(), report=result.report,  # doctest: +SKIP
    ...                    replays=list(result.replays), run_dir="runs/attn")
"""
from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from .outputs import atomic_write_text
from .png import figure_png_b64
from .report import FIGURE_CAPTIONS, _figures, relative_href

__all__ = ["write_autopsy_html"]

_MAX_FIGURES = 4     # replay figures drawn (one per distinct culprit, the answer's first)
_DPI = 90            # 10-inch figures at 900 px, inside the page's 1100 px column: never upscaled
_MAX_LISTED = 32     # snapshots listed
_MAX_EVIDENCE = 4000  # characters of one finding's raw evidence

_REPLAY_CAPTION = ("How to read it: each op's largest |output| in execution order, one line per precision "
                   "(dashes and markers differ, so equal lines stay visible); the red line is the culprit, "
                   "the dash-dot line where backward starts; crosses at the top are NaN/Inf outputs. The lower "
                   "panel zooms on the ops around the culprit, by name. For an underflow, purple diamonds count "
                   "the exact zeros of each output and the orange line marks where they appeared.")
_UPDATE_CAPTION = ("How to read it: the failure is in the optimizer update, so nothing was replayed op by op. "
                   "Top: each parameter's NaN/Inf elements after the update, split by the factor that explains "
                   "them. Bottom: the values the update read at the first of them (log |value|; triangles at "
                   "the bottom are exact zeros, crosses at the top NaN/Inf), with eps and what it rounds to in "
                   "the optimizer state's dtype.")

_CSS = """body{font:14px/1.45 system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.4em}h2{margin-top:1.6em;border-bottom:1px solid #ddd}
.box{padding:.7em 1em;border-radius:6px;background:#fdecea;border:1px solid #e0b4b4}
.box.healthy{background:#eaf6ea;border-color:#b4d8b4}.box .v{font-size:1.35em;font-weight:600}
.verified{color:#1b6e1b}.fails,.changes_result{color:#b00020}.not_tried,.untested{color:#7a5a00}.checked{color:#333}
.error{color:#b00020}.warning{color:#a66300}.info{color:#555}table{border-collapse:collapse;width:100%}
td,th{border-bottom:1px solid #ddd;padding:.35em .5em;text-align:left;vertical-align:top}
tr.primary td{background:#fff6e0}code{font-size:12px;color:#333;word-break:break-all}
img{max-width:100%;margin:.5em 0}.how{color:#555;font-size:.92em;margin-top:0}
pre{white-space:pre-wrap;font-size:12px;background:#f6f6f6;padding:.5em}"""


def _e(v: Any) -> str:
    """Escape anything read from a file for HTML text or a quoted attribute.

    NB: a name unpickled from a file can hold lone surrogates, which UTF-8 cannot encode; they
    are written as backslash escapes instead of failing the whole page.
    """
    text = "-" if v is None else str(v)
    return html.escape(text.encode("utf-8", "backslashreplace").decode("utf-8"), quote=True)


def _num(v: Any) -> str:
    if isinstance(v, float) and math.isfinite(v):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _snapshot_path(snapshot: str | None, run_dir: Path) -> Path | None:
    """The snapshot file as written at analysis time (relative to the working directory), else
    the file of that name in the run's snapshots/ folder, else None."""
    if not snapshot:
        return None
    try:
        p = Path(snapshot)
        if p.is_file():
            return p
        q = run_dir / "snapshots" / p.name
        return q if q.is_file() else None
    except (OSError, ValueError):  # a name no file system accepts (a NUL byte, too long)
        return None


def _snapshot_link(snapshot: str | None, run_dir: Path, page: Path) -> str:
    p = _snapshot_path(snapshot, run_dir)
    if p is None:
        return _e(Path(snapshot).name if snapshot else None)
    return f"<a class='snapshot' href='{_e(relative_href(p, page))}'>{_e(p.name)}</a>"


def _rank_of(snapshot: str | None, report_json: dict) -> Any:
    name = Path(snapshot).name if snapshot else None
    for sn in report_json.get("snapshots") or []:
        if name and Path(str(sn.get("file", ""))).name == name:
            return sn.get("rank")
    return None


def _verdict_box(a: dict, primary: dict | None) -> str:
    c = a.get("culprit") or {}
    summary = (primary or {}).get("summary") or next(iter(a.get("answer") or []), None) \
        or (a.get("report") or {}).get("verdict")
    step = (primary or {}).get("step")
    rank = _rank_of((primary or {}).get("snapshot"), a.get("report") or {})
    facts = [f"step {_e(step)}", f"rank {_e(rank)}", f"precision {_e(c.get('precision'))}"]
    errors = "".join(f"<p class='fails'>{_e(Path(str(x.get('snapshot'))).name)}: the {_e(x.get('stage') or 'replay')} "
                     f"stage failed: {_e(x.get('error') or x.get('message'))}</p>"
                     for x in a.get("errors") or [] if isinstance(x, dict))
    cls = "box healthy" if a.get("verdict") == "healthy" else "box"
    return (f"<section id='verdict' class='{cls}'><div class='v'>Verdict: {_e(a.get('verdict'))}</div>"
            f"<p>{_e(summary)}</p><p>{' &middot; '.join(facts)}</p>{errors}</section>")


def _culprit_table(a: dict, run_dir: Path, page: Path) -> str:
    rows = []
    for r in a.get("replays") or []:
        c = r.get("culprit")
        if not c:
            continue
        main = a.get("culprit") is not None and r is (a.get("replays") or [None])[0]
        rows.append(f"<tr class='{'primary' if main else ''}'><td><b>{_e(c.get('op'))}</b>.{_e(c.get('overload'))}</td>"
                    f"<td>{_e(c.get('module'))}</td>"
                    f"<td><code title='{_e(c.get('source_path'))}'>{_e(c.get('source'))}</code></td>"
                    f"<td>{_e(c.get('phase'))}</td><td>{_e(c.get('precision'))}</td><td>{_e(r.get('step'))}</td>"
                    f"<td>{_e(_rank_of(r.get('snapshot'), a.get('report') or {}))}</td>"
                    f"<td>{_e(r.get('verdict'))}</td><td>{_snapshot_link(r.get('snapshot'), run_dir, page)}</td></tr>")
    if not rows:
        why = ("no snapshot was replayed" if not a.get("replays")
               else "every replayed step ran finite" if a.get("verdict") == "healthy" else "no op was blamed")
        return f"<section id='culprit'><h2>Culprit</h2><p>No culprit: {_e(why)}.</p></section>"
    head = "".join(f"<th>{h}</th>" for h in ("op", "module", "source line", "phase", "precision", "step", "rank",
                                             "verdict", "snapshot"))
    return f"<section id='culprit'><h2>Culprit</h2><table><tr>{head}</tr>{''.join(rows)}</table></section>"


def _fix_line(f: dict) -> str:
    status = f.get("status")
    title = f"<b>{_e(f.get('title') or f.get('name'))}</b>"
    detail = f" &mdash; {_e(f.get('detail'))}" if f.get("detail") else ""
    extra = (f" (largest finite loss scale: {_e(_num(f.get('max_safe_scale')))})"
             if f.get("max_safe_scale") is not None else "")
    if status == "verified":
        tag = "verified"
    elif status == "fails":
        tag = "fails" + (f" at {_e(f.get('failing_op'))}" if f.get("failing_op") else "")
    elif status == "changes_result":
        tag = "changes the result"
    else:
        tag = "not tried"
    return f"<li class='{_e(status)}'><span class='status'>{tag}</span>: {title}{detail}{extra}</li>"


_FIX_GROUPS = (("verified", "Verified on the failing step (recommended)"),
               ("changes_result", "Finite, but far from the FP32 step (not recommended)"),
               ("fails", "Tried and still non-finite (not recommended)"),
               ("not_tried", "Not tried"))


def _fix_lists(fixes: list[dict], advice: list[dict], h: int) -> list[str]:
    """The fixes of one culprit by status, then its advice, under ``<h{h}>`` headings."""
    out = []
    for status, title in _FIX_GROUPS:
        items = [_fix_line(f) for f in fixes if f.get("status") == status]
        if items:
            out.append(f"<h{h}>{title}</h{h}><ul>{''.join(items)}</ul>")
    # Advice that names a fix which failed (or changed the result) is never shown as advice, whatever its own status says.
    failing = {f.get("name") for f in fixes if f.get("status") in ("fails", "changes_result")}
    advice = [x for x in advice if x.get("fix") is None or x.get("fix") not in failing]
    if advice:
        tag = {"verified": "verified", "checked": "checked"}  # anything else reads as untested
        items = "".join(f"<li class='{tag.get(x.get('status'), 'untested')}'>"
                        f"<span class='status'>{tag.get(x.get('status'), 'untested')}"
                        f"</span>: {_e(x.get('text'))}</li>" for x in advice)
        out.append(f"<h{h}>Advice</h{h}><ul>{items}</ul>")
    return out


def _fixes(a: dict) -> str:
    fixes = [f for f in a.get("fixes") or [] if isinstance(f, dict)]
    advice = [x for x in a.get("advice") or [] if isinstance(x, dict)]
    out = ["<section id='fixes'><h2>Fixes tried on the failing step</h2>"]
    if not fixes:
        out.append("<p>No fix was tried.</p>")
    # One list per culprit, the answer's first: fixes verified on one failure are no fix for another.
    steps = {str(r.get("snapshot")): r.get("step") for r in a.get("replays") or [] if isinstance(r, dict)}
    tried = [str(x.get("snapshot")) for x in fixes + advice]
    snaps = list(dict.fromkeys([s for s in steps if s in tried] + tried))
    if len(snaps) <= 1:
        out += _fix_lists(fixes, advice, 3)
    for snap in snaps if len(snaps) > 1 else ():
        out.append(f"<h3>step {_e(steps.get(snap))} ({_e(Path(snap).name)})</h3>")
        out += _fix_lists([f for f in fixes if str(f.get("snapshot")) == snap],
                          [x for x in advice if str(x.get("snapshot")) == snap], 4)
    for s in a.get("shared_fixes") or []:
        out.append(f"<p>{_e(Path(str(s.get('snapshot'))).name)} has the same culprit as "
                   f"{_e(Path(str(s.get('same_culprit_as'))).name)}: the fixes above apply to both.</p>")
    out.append("<p class='how'>Fixes are tried on the snapshot's step, forward and backward only (no optimizer "
               "step): a verified fix makes every gradient of that step finite and its loss match the FP32 "
               "run's within tolerance.</p></section>")
    return "".join(out)


def _same_culprit(autopsy: dict) -> dict[str, str]:
    """Each replayed snapshot whose culprit an earlier one already has -> that earlier snapshot.

    ``shared_fixes`` pairs a snapshot with the first one of its culprit; a snapshot can name one
    that itself names another, so the chain is followed to its first.
    """
    pairs = {str(s.get("snapshot")): str(s.get("same_culprit_as")) for s in autopsy.get("shared_fixes") or []
             if isinstance(s, dict)}
    out = {}
    for snap in pairs:
        first, seen = snap, set()
        while first in pairs and first not in seen:
            seen.add(first)
            first = pairs[first]
        out[snap] = first
    return out


def _figure_groups(replays: list, autopsy: dict) -> list[tuple[Any, list]]:
    """(replay drawn, later replays with its culprit), one per distinct culprit, in replay order."""
    same = _same_culprit(autopsy)
    groups: list[tuple[Any, list]] = []
    index: dict[str, int] = {}
    for r in replays:
        # keyed by the first snapshot of the culprit: the primary can head the answer before it
        key = same.get(str(r.snapshot), str(r.snapshot))
        if key in index:
            groups[index[key]][1].append(r)
        else:
            index[key] = len(groups)
            groups.append((r, []))
    return groups


def _replay_figures(replays: list, autopsy: dict) -> str:
    from .plots import plt
    from .replay import replay_figure

    out = ["<section id='replay'><h2>Replay</h2>"]
    if not replays:
        out.append("<p>No snapshot was replayed.</p>")
    groups = _figure_groups(replays, autopsy)
    for r, later in groups[:_MAX_FIGURES]:
        fig = replay_figure(r)  # an update replay draws its forensics: it has no per-op runs
        try:
            img = figure_png_b64(fig, dpi=_DPI)
        finally:
            plt.close(fig)
        name = _e(Path(str(r.snapshot)).name)
        out.append(f"<h3>step {_e(r.step)} ({name}): {_e(r.verdict)}</h3>"
                   f"<img class='replay' alt='replay figure of {name}' src='data:image/png;base64,{img}'>"
                   f"<p class='how'>{_e(_UPDATE_CAPTION if r.update is not None else _REPLAY_CAPTION)}</p>")
        if later:  # the same op blamed again: its figure would repeat the one above
            items = "".join(f"<li class='same-culprit'>step {_e(x.step)} ({_e(Path(str(x.snapshot)).name)}, "
                            f"{_e(x.reason)}): {_e(x.verdict)}, same culprit as step {_e(r.step)}: "
                            "the figure above</li>" for x in later)
            out.append(f"<ul>{items}</ul>")
    if len(groups) > _MAX_FIGURES:
        out.append(f"<p>{len(groups) - _MAX_FIGURES} more replayed culprit(s) not drawn (--json lists them).</p>")
    out.append("</section>")
    return "".join(out)


def _evidence(f) -> str:
    from ..findings import json_safe

    text = json.dumps(json_safe(f.evidence), indent=1, allow_nan=False)
    if len(text) > _MAX_EVIDENCE:
        text = text[:_MAX_EVIDENCE] + "\n... (truncated; analyzer report --json has all of it)"
    return f"<details><summary>evidence</summary><pre>{_e(text)}</pre></details>"


def _findings(report) -> str:
    items = []
    for f in report.findings:
        at = f" at step {f.step}" if f.step is not None else ""
        on = f" on rank {f.rank}" if f.rank is not None else ""
        items.append(f"<li><span class='{_e(f.severity)}'>{_e(f.severity.capitalize())}{at}{on}</span> "
                     f"({_e(f.check)}): {_e(f.message)}{_evidence(f)}</li>")
    body = f"<ul>{''.join(items)}</ul>" if items else "<p>No findings.</p>"
    notes = "".join(f"<li>{_e(n)}</li>" for n in report.notes)
    return (f"<section id='findings'><h2>Findings of the report</h2><p>{_e(report.verdict)}</p>{body}"
            + (f"<ul>{notes}</ul>" if notes else "") + "</section>")


def _plots(report) -> str:
    from .plots import plt

    out = ["<section id='plots'><h2>Report plots</h2>"]
    for stem, make in _figures(report):
        fig = make()
        try:
            img = figure_png_b64(fig, dpi=_DPI)
        finally:
            plt.close(fig)
        out.append(f"<h3>{_e(stem.replace('_', ' '))}</h3><p class='how'>{_e(FIGURE_CAPTIONS[stem])}</p>"
                   f"<img alt='{_e(stem)}' src='data:image/png;base64,{img}'>")
    out.append("</section>")
    return "".join(out)


def _snapshots(a: dict, run_dir: Path, page: Path) -> str:
    snaps = (a.get("report") or {}).get("snapshots") or []
    items = "".join(f"<li>{_snapshot_link(str(sn.get('file')), run_dir, page)} (step {_e(sn.get('step'))}, "
                    f"rank {_e(sn.get('rank'))}, {_e(sn.get('reason'))})</li>" for sn in snaps[:_MAX_LISTED])
    more = f"<p>... and {len(snaps) - _MAX_LISTED} more.</p>" if len(snaps) > _MAX_LISTED else ""
    return (f"<section id='snapshots'><h2>Snapshots</h2>"
            + (f"<ul>{items}</ul>{more}" if items else "<p>No snapshots.</p>") + "</section>")


def write_autopsy_html(path, autopsy: dict, *, report, replays: list, run_dir) -> Path:
    """Write the autopsy page to `path` (atomically) and return its path.

    Args:
        path: the page to write; snapshot links are made relative to its directory.
        autopsy: the ``analyzer autopsy --json`` object (verdict, culprit, replays, fixes, advice...).
        report: the run's ``Report`` (findings and the frames its plots draw).
        replays: the ``ReplayResult`` of each replayed snapshot, in the order of ``autopsy["replays"]``
            (their per-op traces draw the replay figures).
        run_dir: the run directory (a snapshot not found at its recorded path is looked for in
            its ``snapshots/`` folder).
    """
    page = Path(path)
    run_dir = Path(run_dir)
    reps = [r for r in autopsy.get("replays") or [] if isinstance(r, dict)]
    primary = reps[0] if reps else None
    body = "".join([
        _verdict_box(autopsy, primary),
        _culprit_table(autopsy, run_dir, page),
        _fixes(autopsy),
        _replay_figures(list(replays), autopsy),
        _findings(report) if report is not None else "",  # a checkpoint without a training log: no report
        _plots(report) if report is not None else "",
        _snapshots(autopsy, run_dir, page),
    ])
    title = f"amp-autopsy: {autopsy.get('run') or run_dir.name}"
    doc = (f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title><style>{_CSS}</style>"
           f"</head><body><h1>{_e(title)}</h1>{body}</body></html>")
    return atomic_write_text(page, doc)  # a crash leaves the old file or the new one

"""The replay figure: each precision run's per-op output abs-max along execution order, the culprit marked.

It uses the trace figures' backend and legend rules (``plots``: the Agg backend is chosen there).
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure
from matplotlib.transforms import blended_transform_factory

from .plots import _legend, _plain, plt

__all__ = ["plot_replay_ops"]

# One look per precision, dash pattern and marker both differing: FP16 and BF16 often agree op
# for op until the overflow, and with one plain style the later-drawn line hid the other.
_STYLES = {
    "float32": {"color": "C0", "ls": "-", "lw": 2.2, "alpha": 0.55},
    "float16": {"color": "C3", "ls": "--", "lw": 1.0, "marker": "o", "ms": 3},
    "bfloat16": {"color": "C2", "ls": ":", "lw": 1.6, "marker": "s", "ms": 4, "mfc": "none"},
}
_ZOOM = 12  # ops either side of the culprit in the zoom panel


def _op_series(trace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per op with a floating output: index and output abs-max (NaN where non-finite or all
    zero: a log axis has no place for either), then the non-finite ops to mark, leaving out
    ``-inf`` mask values written on purpose and the ops that only carry them on (their root is a
    literal), and the ops whose output is all zeros."""
    roots = trace.roots  # worked out by the replay's origin analysis (RunTrace.roots)
    xs, ys, bad, zero = [], [], [], []
    for rec in trace.records:
        vals = [trace.absmax[s] for s in rec.outputs]
        if not vals:
            continue
        v = math.nan if any(math.isnan(u) for u in vals) else max(vals)
        xs.append(rec.index)
        if math.isfinite(v):
            ys.append(v if v > 0 else math.nan)
            if v == 0:
                zero.append(rec.index)
        else:
            ys.append(math.nan)
            root = roots[rec.index]
            if not (root.literal and root.index is not None):
                bad.append(rec.index)
    return tuple(np.asarray(a, dtype=float) for a in (xs, ys, bad, zero))


def _zero_counts(trace) -> tuple[np.ndarray, np.ndarray]:
    """Per op, exact zeros in its output (only a run recorded with zero counts has them)."""
    pts = [(rec.index, trace.zero_count(rec)) for rec in trace.records if rec.zeros]
    pts = [(i, z) for i, z in pts if z]  # ops with at least one exact zero
    return np.asarray([i for i, _ in pts], dtype=float), np.asarray([z for _, z in pts], dtype=float)


def _backward_start(trace) -> int | None:
    return next((rec.index for rec in trace.records if rec.phase == "backward"), None)


def _same_series(a, b) -> bool:
    return a[0].shape == b[0].shape and bool(np.array_equal(a[0], b[0])) and bool(
        np.allclose(a[1], b[1], rtol=1e-3, atol=0, equal_nan=True))


def _mark_common(ax, result, trace, lo: float = -math.inf, hi: float = math.inf) -> None:
    """The forward/backward boundary, the culprit and the underflow op, where inside [lo, hi]."""
    top = blended_transform_factory(ax.transData, ax.transAxes)
    b = _backward_start(trace) if trace is not None else None
    if b is not None and lo <= b <= hi:
        ax.axvline(b - 0.5, color="0.25", ls="-.", lw=0.9, gid="backward_start")
        ax.text(b - 0.5, 1.0, " backward ->", transform=top, fontsize=8, color="0.25", va="bottom")
        ax.text(b - 0.5, 1.0, "<- forward ", transform=top, fontsize=8, color="0.25", va="bottom", ha="right")
    c = _headline(result)
    if c and lo <= c["index"] <= hi:
        ax.axvline(c["index"], color="red", lw=1.2, gid="culprit")
        ax.text(c["index"], 0.9, f" culprit #{c['index']} {_plain(c['op'])} ({_plain(c['module'])})", transform=top,
                color="red", fontsize=8, va="top")
    s = c.get("surfaced_at") if c else None  # a forward NaN/Inf a later op hid: where backward failed
    if s and lo <= s["index"] <= hi:
        ax.axvline(s["index"], color="red", ls=":", lw=1.2, gid="surfaced_at")
        ax.text(s["index"], 0.66, f" surfaced #{s['index']} {_plain(s['op'])}", transform=top, color="red",
                fontsize=8, va="top")
    u = result.underflow_at
    if u and lo <= u["index"] <= hi:
        ax.axvline(u["index"], color="darkorange", ls="--", lw=1.2, gid="underflow_at")
        fp32 = u.get("fp32_zeros")
        ax.text(u["index"], 0.78, f" zeros from #{u['index']} {_plain(u['op'])}: {u.get('zeros')}"
                + (f" (FP32: {fp32})" if fp32 is not None else ""), transform=top, color="darkorange",
                fontsize=8, va="top")


def _mark_edges(ax, bad: np.ndarray, zero: np.ndarray, color, precision: str, prefix: str = "") -> None:
    """Crosses at the top edge for NaN/Inf outputs, triangles at the bottom for all-zero ones."""
    edge = blended_transform_factory(ax.transData, ax.transAxes)
    if bad.size:
        ax.scatter(bad, np.full(bad.size, 0.97), transform=edge, marker="x", s=18, color=color, clip_on=False,
                   gid=f"{prefix}nonfinite:{precision}", label=f"NaN/Inf output ({precision}, {bad.size} ops)")
    if zero.size:
        ax.scatter(zero, np.full(zero.size, 0.03), transform=edge, marker="v", s=18, color=color, clip_on=False,
                   gid=f"{prefix}allzero:{precision}", label=f"all-zero output ({precision}, {zero.size} ops)")


def _draw_zeros(ax, trace, lo: float = -math.inf, hi: float = math.inf):
    """Exact zeros per op output on a twin axis: an underflow's cause is a zero, invisible in abs-max."""
    zx, zy = _zero_counts(trace)
    keep = (zx >= lo) & (zx <= hi)
    if not keep.any():
        return None
    twin = ax.twinx()
    twin.plot(zx[keep], zy[keep], ls="none", marker="d", ms=4, color="purple", gid="zeros",
              label=f"exact zeros in output ({trace.precision} run)")
    twin.set_yscale("log")
    twin.set_ylabel("exact zeros in output (count)", color="purple")
    return twin


def plot_replay_ops(result, *, zoom: int = _ZOOM) -> Figure:
    """Per-op output abs-max along execution order, one line per precision, then a zoom on the culprit.

    Each precision has its own dash pattern and marker, and a series equal to an earlier one
    says so in its label. NaN/Inf outputs break the line and are marked with crosses at the top
    (except ``-inf`` mask values written on purpose). The forward/backward boundary, the culprit
    and, for an ``underflow``, the op whose output flushed to zero are vertical lines; an
    underflow also plots the exact-zero count of every op's output, since the zero that caused
    it does not show in an abs-max. The zoom panel shows the ``zoom`` ops either side of the
    culprit by name, in the run the culprit was found in.
    """
    c = result.culprit
    ct = result.culprit_trace if result.culprit_trace is not None else (
        result.traces.get(c["precision"]) if c else None)
    underflow = result.underflow_at is not None and ct is not None
    fig, axes = plt.subplots(2 if c and ct is not None else 1, 1, figsize=(10, 8.5 if c and ct is not None else 4.5),
                             squeeze=False)
    ax = axes[0, 0]
    top_val = 1.0
    drawn: list[tuple[str, tuple]] = []
    for p, trace in result.traces.items():
        xs, ys, bad, zero = _op_series(trace)
        fin = ys[np.isfinite(ys)]
        top_val = max(top_val, float(fin.max()) if fin.size else 1.0)
        same = next((q for q, other in drawn if _same_series((xs, ys), other)), None)
        style = dict(_STYLES.get(p, {"ls": "-.", "lw": 1.0}))
        style.setdefault("markevery", max(1, xs.size // 60))
        label = p + (f" (identical to {same} at every op)" if same else "")
        line, = ax.plot(xs, ys, label=label, gid=f"ops:{p}", **style)
        drawn.append((p, (xs, ys)))
        _mark_edges(ax, bad, zero, line.get_color(), p)
    import torch  # here, not at the top: the report's figures never need it

    for name in ("float16", "bfloat16"):
        limit = float(torch.finfo(getattr(torch, name)).max)
        if limit <= top_val * 100:
            ax.axhline(limit, ls="--", lw=0.8, color="grey")
            ax.text(0, limit, f" {name} max", va="bottom", fontsize=8, color="grey")
    _mark_common(ax, result, ct if ct is not None else next(iter(result.traces.values()), None))
    twin = _draw_zeros(ax, ct) if underflow else None
    _cover_every_op(ax, result)
    ax.set_yscale("log")
    ax.set_xlabel("op index (execution order: forward, then backward)")
    ax.set_ylabel("output abs-max")
    step = f" of step {result.step}" if result.step is not None else ""
    ax.set_title(f"replay{step}: {result.verdict}  (x at top: NaN/Inf output, -inf mask values not shown; "
                 "v at bottom: all-zero output)", pad=14, fontsize=10)
    _legend(ax, twin, fontsize=8)
    if c and ct is not None:
        _zoom_panel(axes[1, 0], result, ct, zoom, underflow)
    fig.tight_layout()
    return fig


def _cover_every_op(ax, result) -> None:
    """x limits over every op: autoscaling skips the NaN points of a line, and the edge marks
    (x in data, y in axes units) do not count, so the last ops' NaN crosses fell past the axes."""
    n = max((len(t.records) for t in result.traces.values()), default=0)
    if n:
        pad = max(1.0, 0.02 * n)
        ax.set_xlim(-pad, n - 1 + pad)


def _headline(result):
    """The culprit the answer leads with (``replay.records.headline``): the text's and ``--json``'s."""
    from ..replay.result.records import headline  # loaded with the replay that made `result`

    return headline(result.culprit)


def _zoom_panel(ax, result, trace, zoom: int, underflow: bool) -> None:
    c = _headline(result)
    lo, hi = max(0, c["index"] - zoom), min(len(trace.records) - 1, c["index"] + zoom)
    xs, ys, bad, zero = _op_series(trace)
    keep = (xs >= lo) & (xs <= hi)
    style = dict(_STYLES.get(trace.precision, {"ls": "-", "lw": 1.0}), marker="o", ms=4)
    line, = ax.plot(xs[keep], ys[keep], label=f"{trace.precision} output abs-max", gid="zoom", **style)
    _mark_edges(ax, bad[(bad >= lo) & (bad <= hi)], zero[(zero >= lo) & (zero <= hi)], line.get_color(),
                trace.precision, prefix="zoom_")
    _mark_common(ax, result, trace, lo, hi)
    twin = _draw_zeros(ax, trace, lo, hi) if underflow else None
    idx = list(range(lo, hi + 1))
    ax.set_xticks(idx, [f"{_plain(trace.records[i].name.removeprefix('aten.'))} #{i}" for i in idx], rotation=70,
                  ha="right", fontsize=7)
    for tick, i in zip(ax.get_xticklabels(), idx):
        if i == c["index"]:
            tick.set_color("red")
            tick.set_fontweight("bold")
    ax.set_xlim(lo - 0.5, hi + 0.5)
    ax.set_yscale("log")
    ax.set_ylabel("output abs-max")
    ax.set_title(f"zoom: ops #{lo}..#{hi} around the culprit ({trace.precision} run)", fontsize=10, pad=14)
    ax.grid(alpha=0.3)
    _legend(ax, twin, fontsize=8)

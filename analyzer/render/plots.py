"""Matplotlib figures of a run's trace; the one place the Agg backend is chosen. Each returns a Figure.

The gradient heatmap is ``heatmap.plot_grad_heatmap`` (it builds on this module's helpers).

Every figure is readable on its own: a title naming the run, labelled axes, log scales where
values span decades. Long runs are downsampled to at most ``MAX_POINTS`` bins (median loss,
minimum scale, any skip / non-finite in the bin), so a 1M-step trace plots in a second.

Two rules every figure keeps, because breaking them once misled a reader:

- a line is broken where its values are missing or non-finite, never drawn straight across the
  gap (the NaN steps are what the reader is looking for), and those steps are marked instead;
- a legend lists only artists that draw something (``_legend``): an entry with no line beside
  it reads as "this series exists and is hidden somewhere".
"""
from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from ..report import LOG_FLOOR, Frames  # noqa: E402

__all__ = ["plot_loss_scale", "plot_stalled_fraction", "plot_grad_vs_depth",
           "plot_replay_ops", "MAX_POINTS"]

MAX_POINTS = 4000
_ZERO_LG = math.log10(LOG_FLOOR) + 1  # at or below: the norm was exactly zero


def _downsample(steps: pl.DataFrame) -> pl.DataFrame:
    cols = ["step", "loss", "scale", "skipped"]
    df = steps.select(cols).with_columns(
        skipped=pl.col("skipped").fill_null(False),
        bad=pl.col("loss").is_not_null() & ~pl.col("loss").is_finite())
    if df.height <= MAX_POINTS:
        return df
    width = math.ceil(df.height / MAX_POINTS)
    return (df.with_row_index("i").group_by(pl.col("i") // width, maintain_order=True)
            .agg(step=pl.col("step").first(),
                 loss=pl.col("loss").filter(pl.col("loss").is_finite()).median(),
                 scale=pl.col("scale").min(), skipped=pl.col("skipped").any(), bad=pl.col("bad").any())
            .drop("i"))


def _plain(name) -> str:
    """A name read from a file (run directory, parameter, module), drawn as written.

    matplotlib parses ``$...$`` in a label as math, and ``run$\\x$`` failed the whole figure
    with "Unknown symbol"; an escaped ``\\$`` is a literal dollar sign. (Turning math off for the
    figure would also break the ``10^k`` labels of its log axes.)
    """
    return str(name).replace("$", r"\$")


def _draws(artist) -> bool:
    """Whether `artist` puts anything on the canvas: a line with a finite point, markers."""
    if hasattr(artist, "get_xydata"):
        xy = np.asarray(artist.get_xydata(), dtype=float)
        return bool(xy.size) and bool(np.isfinite(xy).all(axis=-1).any())
    if hasattr(artist, "get_offsets"):
        return len(artist.get_offsets()) > 0
    return True


def _legend(ax, *twins, outside: bool = True, **kwargs) -> None:
    """One legend on `ax` for the labelled artists of `ax` and its twin axes that draw something;
    no legend when there are none.

    ``outside`` (the default) puts it to the right of the axes, past a twin's axis labels: inside,
    wherever it went, it sat on the points it explains (the NaN crosses at the top right of the
    loss, the ops next to the culprit in the replay's zoom). ``fig.tight_layout()`` makes room.
    """
    pairs = []
    for a in (ax, *[t for t in twins if t is not None]):
        pairs += [(h, lab) for h, lab in zip(*a.get_legend_handles_labels()) if _draws(h)]
    if not pairs:
        return
    if outside:
        pad = 1.09 if any(t is not None for t in twins) else 1.01
        kwargs = {**kwargs, "loc": "upper left", "bbox_to_anchor": (pad, 1.0), "borderaxespad": 0.0}
    ax.legend([h for h, _ in pairs], [lab for _, lab in pairs], **kwargs)


def _title(frames: Frames, what: str, run: str) -> str:
    who = f" (rank {frames.rank})" if frames.rank is not None else ""
    return f"{what}: {_plain(run)}{who}"


def plot_loss_scale(frames: Frames, run: str = "") -> Figure:
    """Loss and loss scale over steps; skipped steps and non-finite losses marked."""
    df = _downsample(frames.steps)
    has_scale = df["scale"].drop_nulls().len() > 0
    fig, axes = plt.subplots(2 if has_scale else 1, 1, sharex=True, figsize=(10, 6 if has_scale else 3.8),
                             squeeze=False)
    ax = axes[0, 0]
    x = df["step"].to_numpy()
    loss = df["loss"].to_numpy().astype(float)
    fin = np.isfinite(loss)
    # NaN where the loss is missing or non-finite: matplotlib breaks the line there instead of
    # joining the last finite step to the next one across the failure.
    ax.plot(x, np.where(fin, loss, np.nan), lw=0.8, color="C0", label="loss", gid="loss")
    if fin.any() and (loss[fin] > 0).all() and loss[fin].max() / loss[fin].min() > 30:
        ax.set_yscale("log")
    top = blended_transform_factory(ax.transData, ax.transAxes)
    bad = df["bad"].to_numpy()
    if bad.any():
        ax.scatter(x[bad], np.full(bad.sum(), 0.97), transform=top, marker="x", color="red", s=25,
                   label=f"non-finite loss ({int(bad.sum())})", clip_on=False, gid="nonfinite_loss")
    skipped = df["skipped"].to_numpy()
    if skipped.any():
        ax.scatter(x[skipped], np.full(skipped.sum(), 0.03), transform=top, marker="|", color="C1", s=40,
                   label=f"skipped step ({int(skipped.sum())})", gid="skipped")
    if x.size:  # every step, even the NaN ones at the end that autoscaling skips (their crosses)
        pad = max(0.5, 0.01 * float(x[-1] - x[0]))
        ax.set_xlim(float(x[0]) - pad, float(x[-1]) + pad)
    ax.set_ylabel("loss")
    ax.set_title(_title(frames, "Loss and loss scale", run))
    _legend(ax, fontsize=8)
    ax.grid(alpha=0.3)
    if has_scale:
        ax2 = axes[1, 0]
        sc = df["scale"].to_numpy().astype(float)
        ok = np.isfinite(sc) & (sc > 0)
        ax2.step(x, np.where(ok, sc, np.nan), where="post", color="C2", lw=1, gid="scale")
        ax2.set_yscale("log", base=2)
        ax2.axhline(1.0, color="red", lw=0.6, ls="--", label="scale 1 (collapse)")
        ax2.set_ylabel("loss scale (log2)")
        _legend(ax2, fontsize=8)
        ax2.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    return fig


def _matrix(frames: Frames) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lb = frames.layer_bins
    bins = lb["bin"].unique().sort().to_numpy()
    layers = np.arange(int(lb["layer"].max()) + 1)
    m = np.full((layers.size, bins.size), np.nan)
    bi = np.searchsorted(bins, lb["bin"].to_numpy())
    lg = lb["lg"].to_numpy().astype(float)
    m[lb["layer"].to_numpy(), bi] = lg
    step_lo = lb.group_by("bin").agg(pl.col("step_lo").min()).sort("bin")["step_lo"].to_numpy()
    return m, layers, step_lo


def _layer_ticks(ax, frames: Frames, n: int, axis: str = "y") -> None:
    every = max(1, math.ceil(n / 40))
    ticks = np.arange(0, n, every)
    labels = [_plain(frames.param_name(int(i))) for i in ticks]
    if axis == "y":
        ax.set_yticks(ticks, labels, fontsize=7 if n > 15 else 8)
    else:
        ax.set_xticks(ticks, labels, fontsize=7, rotation=60, ha="right")


def plot_stalled_fraction(frames: Frames, sf: pl.DataFrame, run: str = "") -> Figure:
    """Fraction of parameters (by element count) whose gradient is stalled, over steps.

    `sf` is ``Report.stalled_fraction`` (columns ``step``, ``frac``): the report computes it,
    the figure only draws it.
    """
    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.plot(sf["step"].to_numpy(), sf["frac"].to_numpy(), color="C3", lw=1)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of parameters stalled")
    ax.set_title(_title(frames, "Stalled parameters (grad < 1e-9 or < 1e-4 x median layer)", run))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_grad_vs_depth(frames: Frames, run: str = "", n_lines: int = 4) -> Figure:
    """Gradient norm against depth (model order) at a few steps spread over the run."""
    m, layers, step_lo = _matrix(frames)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    cols = np.unique(np.linspace(0, m.shape[1] - 1, n_lines).round().astype(int))
    cmap = plt.get_cmap("plasma")
    bottom = blended_transform_factory(ax.transData, ax.transAxes)
    for j, c in enumerate(cols):
        y = m[:, c]
        ok = np.isfinite(y) & (y > _ZERO_LG)
        color = cmap(j / max(1, len(cols)))
        gaps = int((~np.isfinite(y)).sum())
        label = f"step {int(step_lo[c])}" + (f" ({gaps} layer(s) non-finite or missing: gap)" if gaps else "")
        # NaN breaks the line at a layer with no finite norm instead of joining its neighbours
        ax.plot(layers, np.where(ok, 10 ** np.where(ok, y, 0), np.nan), marker="o", ms=3, lw=1, color=color,
                label=label)
        zero = np.isfinite(y) & (y <= _ZERO_LG)
        if zero.any():  # labelled with its step: the triangles of two steps differ only in colour
            ax.scatter(layers[zero], np.full(zero.sum(), 0.02), transform=bottom, marker="v", color=color,
                       label=f"step {int(step_lo[c])}: exactly zero gradient ({int(zero.sum())} layer(s))",
                       clip_on=False, gid=f"zero_grad:{int(step_lo[c])}")
    ax.set_yscale("log")
    _layer_ticks(ax, frames, layers.size, axis="x")
    ax.set_ylabel("gradient norm (unscaled, log)")
    ax.set_xlabel("parameter, input -> output")
    ax.set_title(_title(frames, "Gradient norm against depth", run))
    _legend(ax, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# -- replay: per-op output range along execution order ----------------------------------------
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
    from ..replay.records import headline  # loaded with the replay that made `result`

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

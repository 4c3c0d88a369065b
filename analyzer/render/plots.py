"""Matplotlib figures of a run's trace; the one place the Agg backend is chosen. Each returns a Figure.

The gradient heatmap is ``heatmap.plot_grad_heatmap`` and the replay figure ``replay_plot.plot_replay_ops``
(both build on this module's helpers).

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

__all__ = ["plot_loss_scale", "plot_stalled_fraction", "plot_grad_vs_depth", "MAX_POINTS"]

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

"""Matplotlib figures of a run's trace; the one place the Agg backend is chosen. Each returns a Figure.

Every figure is readable on its own: a title naming the run, labelled axes, log scales where
values span decades. Long runs are downsampled to at most ``MAX_POINTS`` bins (median loss,
minimum scale, any skip / non-finite in the bin), so a 1M-step trace plots in a second.
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

from ..report.checks.frames import LOG_FLOOR, Frames  # noqa: E402

__all__ = ["plot_loss_scale", "plot_grad_heatmap", "plot_stalled_fraction", "plot_grad_vs_depth", "MAX_POINTS"]

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


def _title(frames: Frames, what: str, run: str) -> str:
    who = f" (rank {frames.rank})" if frames.rank is not None else ""
    return f"{what}: {run}{who}"


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
    ax.plot(x[fin], loss[fin], lw=0.8, color="C0", label="loss")
    if fin.any() and (loss[fin] > 0).all() and loss[fin].max() / loss[fin].min() > 30:
        ax.set_yscale("log")
    top = blended_transform_factory(ax.transData, ax.transAxes)
    bad = df["bad"].to_numpy()
    if bad.any():
        ax.scatter(x[bad], np.full(bad.sum(), 0.97), transform=top, marker="x", color="red", s=25,
                   label=f"non-finite loss ({int(bad.sum())})", clip_on=False)
    skipped = df["skipped"].to_numpy()
    if skipped.any():
        ax.scatter(x[skipped], np.full(skipped.sum(), 0.03), transform=top, marker="|", color="C1", s=40,
                   label=f"skipped step ({int(skipped.sum())})")
    ax.set_ylabel("loss")
    ax.set_title(_title(frames, "Loss and loss scale", run))
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    if has_scale:
        ax2 = axes[1, 0]
        sc = df["scale"].to_numpy().astype(float)
        ok = np.isfinite(sc) & (sc > 0)
        ax2.step(x[ok], sc[ok], where="post", color="C2", lw=1)
        ax2.set_yscale("log", base=2)
        ax2.axhline(1.0, color="red", lw=0.6, ls="--", label="scale 1 (collapse)")
        ax2.set_ylabel("loss scale (log2)")
        ax2.legend(loc="upper right", fontsize=8)
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
    labels = [frames.param_name(int(i)) for i in ticks]
    if axis == "y":
        ax.set_yticks(ticks, labels, fontsize=7 if n > 15 else 8)
    else:
        ax.set_xticks(ticks, labels, fontsize=7, rotation=60, ha="right")


def plot_grad_heatmap(frames: Frames, run: str = "") -> Figure:
    """log10 unscaled gradient norm per parameter (rows, model order) over steps (columns)."""
    m, layers, step_lo = _matrix(frames)
    fig, ax = plt.subplots(figsize=(10, max(3.5, min(12, 0.25 * layers.size + 1.5))))
    x1 = step_lo[-1] + frames.bin_width if step_lo.size else 1
    zero = m <= _ZERO_LG  # clipped log of an exactly-zero norm: its own colour, not the scale's end
    finite = m[np.isfinite(m) & ~zero]
    vmin, vmax = (np.percentile(finite, 1), np.percentile(finite, 99.5)) if finite.size else (-10, 0)
    cmap = plt.get_cmap("viridis").with_extremes(under="black", bad="white")
    shown = np.where(zero, vmin - 1, m)
    im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap=cmap, vmin=vmin, vmax=vmax,
                   extent=(step_lo[0] if step_lo.size else 0, x1, layers.size - 0.5, -0.5))
    fig.colorbar(im, ax=ax, label="log10 grad norm (unscaled)", extend="min")
    _layer_ticks(ax, frames, layers.size)
    ax.set_xlabel(f"step ({frames.bin_width} step(s) per column)" if frames.bin_width > 1 else "step")
    ax.set_ylabel("parameter (input at top, output at bottom)")
    ax.set_title(_title(frames, "Per-layer gradient norm", run) + "\nblack: exactly zero, white: non-finite (overflow)",
                 fontsize=11)
    fig.tight_layout()
    return fig


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
        ax.plot(layers[ok], 10 ** y[ok], marker="o", ms=3, lw=1, color=color, label=f"step {int(step_lo[c])}")
        zero = np.isfinite(y) & (y <= _ZERO_LG)
        if zero.any():
            ax.scatter(layers[zero], np.full(zero.sum(), 0.02), transform=bottom, marker="v", color=color,
                       label="exactly zero gradient" if j == 0 else None, clip_on=False)
    ax.set_yscale("log")
    _layer_ticks(ax, frames, layers.size, axis="x")
    ax.set_ylabel("gradient norm (unscaled, log)")
    ax.set_xlabel("parameter, input -> output")
    ax.set_title(_title(frames, "Gradient norm against depth", run))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig

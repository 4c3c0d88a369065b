"""The gradient heatmap: log10 gradient norm per parameter (rows) over steps (columns).

Three kinds of cell lie outside the colour scale, and each has a colour no scale value has:
red, a NaN/Inf norm in the cell's steps (an overflow: what the reader is looking for); black, an
exactly-zero norm; white, no gradient recorded (a parameter outside the graph that step). White
once meant NaN/Inf and read as missing data. Red and black are the colour bar's two end
swatches, labelled "NaN/Inf" and "exactly 0"; finite norms beyond the scale's 1st..99.5th
percentiles take the scale's own end colours, so neither swatch is ever a finite value.

Example:
    >>> fig = plot_grad_heatmap(report.frames, "run")  # doctest: +SKIP
"""
from __future__ import annotations

import numpy as np
import polars as pl
from matplotlib.figure import Figure

from ..report import Frames
from .plots import _ZERO_LG, _layer_ticks, _matrix, _title, plt

__all__ = ["plot_grad_heatmap", "NONFINITE_COLOR", "ZERO_COLOR", "MISSING_COLOR"]

# A NaN/Inf cell: red sits outside viridis (purple to yellow) and reads as an alarm, where the
# white it replaced read as "no data". White is left to cells with no gradient recorded.
NONFINITE_COLOR = "#e41a1c"
ZERO_COLOR = "black"
MISSING_COLOR = "white"


def _bad_cells(frames: Frames, shape: tuple[int, int]) -> np.ndarray:
    """Per (layer, bin): some step of the bin recorded a NaN/Inf gradient norm for the layer."""
    lb = frames.layer_bins
    bad = np.zeros(shape, dtype=bool)
    if "n_bad" not in lb.columns:
        return bad
    bins = lb["bin"].unique().sort().to_numpy()
    hit = lb.filter(pl.col("n_bad") > 0)
    bad[hit["layer"].to_numpy(), np.searchsorted(bins, hit["bin"].to_numpy())] = True
    return bad


def plot_grad_heatmap(frames: Frames, run: str = "") -> Figure:
    """log10 unscaled gradient norm per parameter (rows, model order) over steps (columns).

    Three cells lie outside the colour scale, each with its own colour: red, a NaN/Inf norm in
    the cell's steps (the colour bar's top end); black, an exactly-zero one (its bottom end);
    white, no gradient recorded.
    """
    m, layers, step_lo = _matrix(frames)
    bad = _bad_cells(frames, m.shape)
    fig, ax = plt.subplots(figsize=(10, max(3.5, min(12, 0.25 * layers.size + 1.5))))
    x1 = step_lo[-1] + frames.bin_width if step_lo.size else 1
    zero = m <= _ZERO_LG  # clipped log of an exactly-zero norm: its own colour, not the scale's end
    finite = m[np.isfinite(m) & ~zero]
    vmin, vmax = (np.percentile(finite, 1), np.percentile(finite, 99.5)) if finite.size else (-10, 0)
    if vmax <= vmin:
        vmax = vmin + 1.0
    cmap = plt.get_cmap("viridis").with_extremes(under=ZERO_COLOR, over=NONFINITE_COLOR, bad=MISSING_COLOR)
    # finite norms outside the 1st..99.5th percentiles take the scale's end colours, so "under"
    # (black) is exactly zero only and "over" (red) NaN/Inf only
    shown = np.where(zero, vmin - 1, np.clip(m, vmin, vmax))
    shown = np.where(bad, vmax + 1, shown)
    im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap=cmap, vmin=vmin, vmax=vmax,
                   extent=(step_lo[0] if step_lo.size else 0, x1, layers.size - 0.5, -0.5))
    cb = fig.colorbar(im, ax=ax, label="log10 grad norm (unscaled)", extend="both", extendfrac=0.08)
    # the two ends of the bar are the swatches of the two colours outside the scale
    cb.ax.text(0.5, 1.1, "NaN/Inf", transform=cb.ax.transAxes, ha="center", va="bottom", fontsize=8,
               color=NONFINITE_COLOR, fontweight="bold", gid="swatch_nonfinite")
    cb.ax.text(0.5, -0.1, "exactly 0", transform=cb.ax.transAxes, ha="center", va="top", fontsize=8,
               gid="swatch_zero")
    _layer_ticks(ax, frames, layers.size)
    ax.set_xlabel(f"step ({frames.bin_width} step(s) per column)" if frames.bin_width > 1 else "step")
    ax.set_ylabel("parameter (input at top, output at bottom)")
    ax.set_title(_title(frames, "Per-layer gradient norm", run)
                 + "\nred: NaN/Inf (overflow), black: exactly zero, white: no gradient recorded", fontsize=11)
    fig.tight_layout()
    return fig

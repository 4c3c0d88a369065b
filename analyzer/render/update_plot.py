"""The replay figure of an update snapshot: what the optimizer-update forensics found, drawn.

An update snapshot (``Recorder(check_update=True)``), or one whose NaN/Inf weights its saved
optimizer state explains, is not replayed forward and backward (``ReplayResult.runs`` is empty,
``ReplayResult.update`` holds ``analyzer.replay.update.forensics``'s forensics), so the per-op figure of
``replay_plot.plot_replay_ops`` would be empty axes. This one draws the forensics instead:

- top: per parameter (most NaN/Inf elements first), its NaN/Inf elements as one bar split by the
  factor that explains them (``grad``, ``state``, ``eps_flush``, ``update_overflow``,
  ``weight_overflow``, ``unexplained``), labelled "56 of 64 NaN/Inf (float16, state float16)";
- bottom: the values the update read at the first NaN/Inf elements (gradient, ``exp_avg``,
  ``exp_avg_sq`` or ``momentum_buffer``, the recomputed update, the weight), as |value| on a log
  axis. A log axis has no place for 0 or NaN/Inf, and they are the point: an exact 0 is a
  triangle at the bottom edge, a NaN/Inf a cross at the top edge. The configured ``eps`` is a
  dashed line, and the legend says what it rounds to in the state's dtype (``1e-08 (0 in
  float16)``: the Adam eps flush).

How to read the pure-FP16 Adam example (``tests/update_runs.py``): one bar, ``emb.weight``, all
``eps_flush``; below, ``exp_avg`` and ``exp_avg_sq`` sit on the zero edge, the update and the
weight on the NaN edge, and eps reads ``1e-08 (0 in float16)``: 0 / (sqrt(0) + 0) = NaN.

Example:
    >>> from analyzer.render.update_plot import plot_update_forensics
    >>> fig = plot_update_forensics(replay_snapshot("run/snapshots/step00000003-r00000-update.pt"))  # doctest: +SKIP
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from matplotlib.transforms import blended_transform_factory

from .plots import _legend, _plain, plt

__all__ = ["plot_update_forensics", "FACTORS"]

# The forensics' factors, in the order replay/update/forensics.py assigns them, and how the legend names them.
FACTORS = {
    "grad": "gradient NaN/Inf",
    "state": "optimizer state NaN/Inf",
    "eps_flush": "exp_avg_sq = 0 and eps rounds to 0",
    "update_overflow": "update past the dtype's max",
    "weight_overflow": "weight + update past the dtype's max",
    "unexplained": "no factor explains it",
}
_COLORS = {"grad": "C3", "state": "C1", "eps_flush": "C4", "update_overflow": "C0", "weight_overflow": "C9",
           "unexplained": "0.5"}
_MAX_BARS = 20   # parameters in the bar panel
_MAX_VALUES = 4  # parameters whose example values are drawn
# The values panel's y range. A float64 state can hold 1e-300 beside 1e300, and a log axis over
# 600 decades fails matplotlib's tick locator (OverflowError); no float32/16 value is past 1e39.
_LO, _HI = 1e-200, 1e200


def _value(v) -> float:
    """A forensics number as a float (the dict holds floats; after JSON, "nan"/"inf" strings)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def plot_update_forensics(result) -> Figure:
    """Per parameter: NaN/Inf elements by factor, and the values the update read there."""
    u = result.update or {}
    params = sorted(u.get("params") or [], key=lambda p: -int(p.get("nonfinite", 0)))
    step = "" if result.step is None else (f" of step {result.step}" if u.get("update_snapshot") else
                                           f" before step {result.step} (its weights are already NaN/Inf)")
    title = (f"update forensics{step}: {result.verdict} ({_plain(u.get('optimizer', 'optimizer'))}; "
             "forward and backward not replayed)")
    if not params:
        fig, ax = plt.subplots(figsize=(10, 2.5))
        ax.set_axis_off()
        ax.set_title(title, fontsize=10)
        ax.text(0.5, 0.5, "no parameter is NaN/Inf after the update: nothing to plot", ha="center", va="center",
                transform=ax.transAxes, gid="nothing_to_plot")
        return fig
    shown = params[:_MAX_BARS]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5 + 0.3 * len(shown)),
                                      gridspec_kw={"height_ratios": [0.5 + 0.25 * len(shown), 3.0]})
    _factor_bars(top, shown, len(params))
    top.set_title(title, fontsize=10)
    _example_values(bottom, params[:_MAX_VALUES], u)
    fig.tight_layout()
    return fig


def _factor_bars(ax, params: list[dict], total: int) -> None:
    y = np.arange(len(params))
    left = np.zeros(len(params))
    for factor, label in FACTORS.items():
        n = np.asarray([int(p["factors"].get(factor, 0)) for p in params], dtype=float)
        if n.any():
            ax.barh(y, n, left=left, color=_COLORS[factor], label=f"{factor}: {label}", gid=f"factor:{factor}")
            left += n
    for i, p in enumerate(params):
        ax.text(left[i], i, f"  {p['nonfinite']} of {p['numel']} NaN/Inf ({p['dtype']}, state {p['state_dtype']})",
                va="center", fontsize=8, gid=f"count:{p['name']}")
    ax.set_yticks(y, [_plain(p["name"]) for p in params], fontsize=8)
    ax.invert_yaxis()  # most NaN/Inf elements at the top
    ax.set_xlim(0, max(1.0, float(left.max())) * 1.6)  # room for the counts beside the bars
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # element counts
    ax.set_xlabel("NaN/Inf elements after the update, by the factor that explains them"
                  + (f" ({total - len(params)} more parameters not shown)" if total > len(params) else ""))
    _legend(ax, fontsize=8)


def _example_values(ax, params: list[dict], u: dict) -> None:
    """|value| of each quantity the update read, at each parameter's first NaN/Inf elements."""
    keys: list[str] = []
    for p in params:
        for ex in p.get("examples") or []:
            keys += [k for k in ex if k != "index" and k not in keys]
    edge = blended_transform_factory(ax.transData, ax.transAxes)
    finite_vals: list[float] = []
    width = 0.6 / max(1, len(params))
    for j, p in enumerate(params):
        color = f"C{j}"
        name = _plain(p["name"])
        pts = [(keys.index(k) - 0.3 + width * (j + 0.5), _value(v)) for ex in p.get("examples") or []
               for k, v in ex.items() if k != "index"]
        xs = np.asarray([x for x, _ in pts], dtype=float)
        vs = np.asarray([v for _, v in pts], dtype=float)
        fin = np.isfinite(vs) & (vs != 0)
        zero = vs == 0
        bad = ~np.isfinite(vs)
        mag = np.clip(np.abs(vs[fin]), _LO, _HI)
        ax.plot(xs[fin], mag, ls="none", marker="o", color=color, label=f"{name}: |value|", gid=f"values:{p['name']}")
        if zero.any():
            ax.scatter(xs[zero], np.full(zero.sum(), 0.03), transform=edge, marker="v", s=30, color=color,
                       clip_on=False, label=f"{name}: exactly 0", gid=f"zero:{p['name']}")
        if bad.any():
            ax.scatter(xs[bad], np.full(bad.sum(), 0.97), transform=edge, marker="x", s=30, color=color,
                       clip_on=False, label=f"{name}: NaN/Inf", gid=f"nonfinite:{p['name']}")
        finite_vals += list(mag)
        eps = p.get("hyperparameters", {}).get("eps")
        if j == 0 and isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps < math.inf:
            at = min(max(eps, _LO), _HI)
            ax.axhline(at, color="red", ls="--", lw=0.9, gid="eps",
                       label=f"eps = {eps:g} ({_value(p.get('eps_in_dtype')):g} in {p['state_dtype']})")
            finite_vals.append(at)
    lo = min(finite_vals) if finite_vals else 1e-3
    hi = max(finite_vals) if finite_vals else 1.0
    ax.set_yscale("log")
    ax.set_ylim(max(lo / 30, _LO), min(hi * 30, _HI))  # a decade and a half of margin
    ax.set_xticks(range(len(keys)), [_plain(k) for k in keys], fontsize=9)
    ax.set_xlim(-0.6, len(keys) - 0.4)
    ax.set_ylabel("|value| (log; v at bottom: exactly 0, x at top: NaN/Inf)")
    formula = next((p["formula"] for p in params if p.get("formula")), None)
    ax.set_title("values at the first NaN/Inf elements" + (f": update = {formula}" if formula else
                                                           " (no update formula is known for this optimizer)"),
                 fontsize=9, pad=12)
    if u.get("clip_signature"):
        ax.text(0.5, 0.88, "every finite gradient element is exactly 0 beside the NaN ones: clip_grad_norm_ over "
                "an infinite total norm (clip coefficient 0, 0 * inf = NaN)", transform=ax.transAxes, ha="center",
                fontsize=8, color="C3", gid="clip_signature", wrap=True)
    ax.grid(alpha=0.3)
    _legend(ax, fontsize=8)

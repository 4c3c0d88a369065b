"""What a reader of the figures must not be misled by, read back from the drawn figures.

- the gradient heatmap's NaN/Inf cells have a colour of their own (not white, which reads as "no
  data"), shown as a swatch at the end of the colour bar; cells with no gradient stay white;
- no legend covers a point it explains: every drawn point lies outside every legend's box;
- the grad-vs-depth plot's zero-gradient triangles are labelled with their step;
- the pages' palette PNGs look like matplotlib's own PNG, at a fraction of the bytes.

The report figures are drawn from scripted traces written as real run directories (hypothesis
picks the cells); the replay figures from real replays recorded by the real ``Recorder``.
"""
from __future__ import annotations

import io
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import polars as pl
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from matplotlib.colors import to_rgba
from PIL import Image

from analyzer.render import heatmap, plots, replay_plot
from analyzer.render.heatmap import NONFINITE_COLOR
from analyzer.render.png import figure_png
from analyzer.render.update_plot import plot_update_forensics
from analyzer.replay import replay_snapshot
from analyzer.report import build_report
from recorders import schema

from ..replay import replay_models as rm
from ..report.report_models import Script

N, L = 60, 5
_cells = st.sets(st.tuples(st.integers(0, N - 1), st.integers(0, L - 1)), max_size=25)


def _write(s: Script, d: Path, no_grad: set) -> Path:
    """`s` as a run directory, with a null gradient norm (no gradient) at the cells `no_grad`."""
    run = s.write(d / "run")
    for part in sorted((run / schema.TRACE_DIR).glob("layers-*")):
        df = pl.read_parquet(part)
        hit = pl.lit(False)
        for step, layer in no_grad:
            hit = hit | ((pl.col("step") == step) & (pl.col("layer") == layer))
        df.with_columns(grad_norm=pl.when(hit).then(None).otherwise(pl.col("grad_norm"))).write_parquet(part)
    return run


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad=_cells, zero=_cells, no_grad=_cells)
def test_heatmap_cells_are_red_for_nan_inf_black_for_zero_white_for_no_gradient(bad, zero, no_grad):
    zero, no_grad = zero - bad, no_grad - bad - zero
    s = Script(n=N, n_layers=L)
    for i, j in bad:
        s.lg[i, j] = np.nan if (i + j) % 2 else np.inf  # grad_norm NaN or Inf
    for i, j in zero:
        s.lg[i, j] = -np.inf  # grad_norm exactly 0
    with tempfile.TemporaryDirectory() as d:
        rep = build_report(_write(s, Path(d), no_grad))
    fig = heatmap.plot_grad_heatmap(rep.frames, "run")
    try:
        ax = fig.axes[0]
        im, = ax.images
        rgba = im.to_rgba(im.get_array())  # rows: layers; columns: steps (one step per column here)
        assert rgba.shape[:2] == (L, N)
        want = {c: to_rgba(NONFINITE_COLOR) for c in bad}
        want |= {c: to_rgba("black") for c in zero} | {c: to_rgba("white") for c in no_grad}
        special = {tuple(np.round(v, 3)) for v in want.values()} | {(1.0, 1.0, 1.0, 1.0), (0.0, 0.0, 0.0, 1.0)}
        for i in range(N):
            for j in range(L):
                got = tuple(np.round(rgba[j, i], 3))
                if (i, j) in want:
                    assert got == tuple(np.round(want[(i, j)], 3)), (i, j)
                else:  # a finite norm: a colour of the scale, never one of the three
                    assert got not in special | {tuple(np.round(to_rgba(NONFINITE_COLOR), 3))}, (i, j)
        cbar = fig.axes[1]
        swatches = {t.get_gid(): t.get_text() for t in cbar.texts}
        assert swatches == {"swatch_nonfinite": "NaN/Inf", "swatch_zero": "exactly 0"}
        cmap = im.get_cmap()
        assert to_rgba(cmap.get_over()) == to_rgba(NONFINITE_COLOR) and to_rgba(cmap.get_under()) == to_rgba("black")
        assert im.colorbar.extend == "both"  # the two ends of the bar are the two swatches
    finally:
        plt.close(fig)


def _points(fig) -> list[tuple[str, np.ndarray]]:
    """(label, display coordinates) of every drawn point of every line and scatter in `fig`."""
    out = []
    for ax in fig.axes:
        box = ax.get_window_extent()
        for art in (*ax.lines, *ax.collections):
            if hasattr(art, "get_xydata"):
                xy = art.get_transform().transform(np.asarray(art.get_xydata(), dtype=float))
            elif hasattr(art, "get_offsets") and len(art.get_offsets()):
                xy = art.get_offset_transform().transform(np.asarray(art.get_offsets(), dtype=float))
            else:
                continue
            xy = xy[np.isfinite(xy).all(axis=1)]
            if art.get_clip_on():  # a clipped artist draws only inside its axes
                xy = xy[(xy[:, 0] >= box.x0) & (xy[:, 0] <= box.x1) & (xy[:, 1] >= box.y0) & (xy[:, 1] <= box.y1)]
            out.append((art.get_label(), xy))
    return out


def _no_legend_covers_a_point(fig) -> int:
    fig.canvas.draw()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    for leg in legends:
        box = leg.get_window_extent()
        # beside the axes, not on them: bars and lines are inside an axes' box, never under a legend
        assert not [ax for ax in fig.axes if box.overlaps(ax.get_window_extent())]
        for label, xy in _points(fig):
            inside = (xy[:, 0] > box.x0) & (xy[:, 0] < box.x1) & (xy[:, 1] > box.y0) & (xy[:, 1] < box.y1)
            assert not inside.any(), f"the legend covers {int(inside.sum())} point(s) of {label!r}"
    return len(legends)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad_loss=st.sets(st.integers(0, N - 1), max_size=30), zero=_cells)
def test_no_report_legend_covers_a_point_and_each_zero_triangle_is_labelled_with_its_step(bad_loss, zero):
    s = Script(n=N, n_layers=L)
    for i in bad_loss:
        s.loss[i] = np.nan  # red crosses along the top, where a legend in the corner used to sit
    for i, j in zero:
        s.lg[i, j] = -np.inf
    with tempfile.TemporaryDirectory() as d:
        rep = build_report(s.write(Path(d) / "run"))
    for make in (plots.plot_loss_scale, plots.plot_grad_vs_depth):
        fig = make(rep.frames, "run")
        try:
            assert _no_legend_covers_a_point(fig) >= 1
            if make is plots.plot_grad_vs_depth:
                entries = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
                plotted = sorted({int(v) for v in np.linspace(0, N - 1, 4).round()})
                for step in plotted:
                    layers = sorted(j for i, j in zero if i == step)
                    marks = [c for c in fig.axes[0].collections if c.get_gid() == f"zero_grad:{step}"]
                    if not layers:
                        assert not marks
                        continue
                    mark, = marks
                    assert sorted(mark.get_offsets()[:, 0].astype(int)) == layers
                    assert f"step {step}: exactly zero gradient ({len(layers)} layer(s))" in entries
        finally:
            plt.close(fig)


@pytest.fixture(scope="module")
def underflow_replay(tmp_path_factory):
    # gain 10: p(class 2) ~ 4e-18 rounds to 0 in FP16, then log(0) (pinned in test_replay.py)
    return replay_snapshot(rm.record_step(
        tmp_path_factory.mktemp("under"), factory="build_classifier", loss_fn="log_prob_loss",
        factory_kwargs={"gain": 10.0}, batch={"x": torch.tensor([[2.0, 0, 0, 0], [1.0, 0, 0, 0]]),
                                              "y": torch.tensor([2, 0])}, amp_dtype=torch.float16))


def test_no_replay_legend_covers_a_point_in_the_overview_or_the_zoom(fp16_attention_replay, underflow_replay):
    for result in (fp16_attention_replay, underflow_replay):
        assert result.culprit is not None
        fig = replay_plot.plot_replay_ops(result)
        try:
            assert _no_legend_covers_a_point(fig) == 2  # the overview's and the zoom's
        finally:
            plt.close(fig)


def test_no_update_forensics_legend_covers_a_point_or_a_bar(fp16_adam_eps_update_run, clip_inf_update_run):
    for run in (fp16_adam_eps_update_run, clip_inf_update_run):
        snap = next(p for p in run["snapshots"] if p.stem.endswith("-update"))
        result = replay_snapshot(snap)
        assert result.update is not None
        fig = plot_update_forensics(result)
        try:
            assert _no_legend_covers_a_point(fig) == 2  # the factor bars' and the values'
        finally:
            plt.close(fig)


def test_a_palette_png_looks_like_matplotlibs_at_a_fraction_of_its_bytes(fp16_attention_replay):
    fig = replay_plot.plot_replay_ops(fp16_attention_replay)
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90, facecolor="white")
        small = figure_png(fig, dpi=90)
    finally:
        plt.close(fig)
    with Image.open(io.BytesIO(small)) as img:
        assert img.mode == "P"
        got = np.asarray(img.convert("RGB"), dtype=float)
    with Image.open(io.BytesIO(buf.getvalue())) as img:
        ref = np.asarray(img.convert("RGB"), dtype=float)
    assert got.shape == ref.shape
    assert len(small) < 0.6 * len(buf.getvalue())
    diff = np.abs(got - ref).max(axis=2)
    assert diff.mean() < 2.0 and (diff > 40).mean() < 0.002  # the same picture, edges a shade off at most

"""``analyzer.render.plots``: what the figures draw, read back from the matplotlib artists.

The report figures are drawn from scripted traces written as real run directories (hypothesis
picks which steps and layers go non-finite); the replay figures from real replays of steps
recorded by the real ``Recorder`` on tiny CPU models (``replay_models.py``).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.render import heatmap, plots, replay_plot
from analyzer.replay import replay_snapshot
from analyzer.report import build_report

from ..replay import replay_models as rm
from ..report.report_models import Script

N = 60


def _artists(fig):
    for ax in fig.axes:
        yield from ax.lines
        yield from ax.collections
        yield from ax.containers  # bars: one legend entry per BarContainer


def _draws(artist) -> bool:
    if hasattr(artist, "patches"):
        return any(p.get_width() and p.get_height() for p in artist.patches)
    if hasattr(artist, "get_xydata"):
        xy = np.asarray(artist.get_xydata(), dtype=float)
        return bool(xy.size) and bool(np.isfinite(xy).all(axis=1).any())
    return len(artist.get_offsets()) > 0


def _legend_ok(fig) -> list[str]:
    """Every legend entry of `fig` names an artist that draws something; returns the entries."""
    drawn = {a.get_label() for a in _artists(fig) if _draws(a)}
    entries = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert set(entries) <= drawn, f"legend entries with nothing drawn: {set(entries) - drawn}"
    return entries


def _by_gid(fig, gid: str, ax_index: int | None = None):
    axes = fig.axes if ax_index is None else [fig.axes[ax_index]]
    found = [a for ax in axes for a in (*ax.lines, *ax.collections) if a.get_gid() == gid]
    assert found, f"no artist {gid!r}"
    return found


def _report(script: Script):
    with tempfile.TemporaryDirectory() as d:
        return build_report(script.write(Path(d) / "run"))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad_loss=st.sets(st.integers(0, N - 1), max_size=20),
       inf=st.booleans(),
       bad_cells=st.sets(st.tuples(st.integers(0, N - 1), st.integers(0, 3)), max_size=30),
       dead_step=st.sampled_from([None, 0, N - 1]))
def test_the_loss_line_breaks_exactly_at_non_finite_steps_and_every_legend_entry_draws(
        bad_loss, inf, bad_cells, dead_step):
    s = Script(n=N, n_layers=4)
    for i in bad_loss:
        s.loss[i] = np.inf if inf and i % 2 else np.nan
    for i, j in bad_cells:
        s.lg[i, j] = np.nan  # grad_norm 10**nan: a non-finite per-layer norm
    if dead_step is not None:
        s.lg[dead_step, :] = np.nan  # every layer non-finite at one plotted step
    rep = _report(s)
    fig = plots.plot_loss_scale(rep.frames, "run")
    try:
        line, = _by_gid(fig, "loss")
        x, y = line.get_xdata(), np.asarray(line.get_ydata(), dtype=float)
        bad = sorted(bad_loss)
        # NaN in the drawn data is where matplotlib breaks the line: exactly the non-finite steps
        assert sorted(int(v) for v in x[~np.isfinite(y)]) == bad
        good = np.isfinite(y)
        np.testing.assert_allclose(y[good], s.loss[x[good].astype(int)])
        if bad:
            marks, = _by_gid(fig, "nonfinite_loss")
            assert sorted(int(v) for v in marks.get_offsets()[:, 0]) == bad
        entries = _legend_ok(fig)
        assert ("loss" in entries) == (len(bad) < N)
    finally:
        plt.close(fig)
    for make in (heatmap.plot_grad_heatmap, plots.plot_grad_vs_depth):
        fig = make(rep.frames, "run")
        try:
            entries = _legend_ok(fig)
            if make is plots.plot_grad_vs_depth and dead_step is not None:
                assert not any(e.startswith(f"step {dead_step}") for e in entries)
        finally:
            plt.close(fig)


def test_a_loss_that_is_never_finite_gets_no_loss_legend_entry_and_every_step_marked():
    s = Script(n=N, n_layers=4)
    s.loss[:] = np.nan
    fig = plots.plot_loss_scale(_report(s).frames)
    try:
        assert "loss" not in _legend_ok(fig)
        marks, = _by_gid(fig, "nonfinite_loss")
        assert len(marks.get_offsets()) == N
    finally:
        plt.close(fig)


# -- replay figures, from real replays -----------------------------------------------------------
def _exact_weights(model):
    # weights 1/8, biases 0, inputs 1, targets 0: every value on the way (1/2, 1, their gradients
    # divided by powers of two) is exact in FP16 and BF16, so the two runs agree at every op
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.125 if p.dim() > 1 else 0.0)


@pytest.fixture(scope="module")
def replays(tmp_path_factory, fp16_attention_replay):
    d = tmp_path_factory.mktemp("replays")
    out = {}
    out["identical"] = replay_snapshot(rm.record_step(
        d / "exact", factory="build_mlp", loss_fn="mse", batch={"x": torch.ones(4, 4), "y": torch.zeros(4, 1)},
        amp_dtype=torch.float16, manual=True, inject=_exact_weights), dtypes=["fp32", "fp16", "bf16"])
    # gain 8: unscaled attention logits ~1e5 > 65504 (the overflow pinned in test_replay.py; tests/analyzer/conftest.py)
    out["overflow"] = fp16_attention_replay
    # gain 10: p(class 2) ~ 4e-18 rounds to 0 in FP16, then log(0) (pinned in test_replay.py)
    out["underflow"] = replay_snapshot(rm.record_step(
        d / "under", factory="build_classifier", loss_fn="log_prob_loss", factory_kwargs={"gain": 10.0},
        batch={"x": torch.tensor([[2.0, 0, 0, 0], [1.0, 0, 0, 0]]), "y": torch.tensor([2, 0])},
        amp_dtype=torch.float16))
    return out


@pytest.fixture
def figure(replays):
    made = []

    def make(name):
        made.append(replay_plot.plot_replay_ops(replays[name]))
        return made[-1]

    yield make
    for f in made:
        plt.close(f)


def test_identical_fp16_and_bf16_series_differ_in_style_and_say_they_are_identical(replays, figure):
    assert replays["identical"].verdict == "healthy"
    fig = figure("identical")
    fp16, = _by_gid(fig, "ops:float16")
    bf16, = _by_gid(fig, "ops:bfloat16")
    # the defect's situation for real: the same points in both precisions
    np.testing.assert_array_equal(fp16.get_xydata(), bf16.get_xydata())
    assert fp16.get_linestyle() != bf16.get_linestyle() and fp16.get_marker() != bf16.get_marker()
    assert bf16.get_label() == "bfloat16 (identical to float16 at every op)"
    assert fp16.get_label() == "float16"
    _legend_ok(fig)


def test_the_overflow_figure_marks_the_culprit_and_backward_start_and_zooms_by_op_name(replays, figure):
    r = replays["overflow"]
    c, trace = r.culprit, r.culprit_trace
    assert r.verdict == "overflow" and c["op"] == "aten.bmm"
    fig = figure("overflow")
    first_backward = next(rec.index for rec in trace.records if rec.phase == "backward")
    for ax in (0, 1):  # overview, then zoom
        culprit, = _by_gid(fig, "culprit", ax)
        assert list(culprit.get_xdata()) == [c["index"]] * 2
    boundary, = _by_gid(fig, "backward_start", 0)
    assert list(boundary.get_xdata()) == [first_backward - 0.5] * 2
    fp16, = _by_gid(fig, "ops:float16")
    x, y = fp16.get_xdata(), np.asarray(fp16.get_ydata(), dtype=float)
    assert np.isnan(y[list(x).index(c["index"])])  # the inf output breaks the line
    marks, = _by_gid(fig, "nonfinite:float16")
    assert c["index"] in marks.get_offsets()[:, 0]
    zoom = fig.axes[1]
    lo, hi = zoom.get_xlim()
    assert lo < c["index"] < hi and hi - lo <= 2 * replay_plot._ZOOM + 1
    red = [t.get_text() for t in zoom.get_xticklabels() if t.get_color() == "red"]
    assert red == [f"bmm #{c['index']}"]
    _legend_ok(fig)


def test_an_underflow_figure_counts_exact_zeros_and_marks_the_op_where_they_appeared(replays, figure):
    r = replays["underflow"]
    assert r.verdict == "underflow"
    u = r.underflow_at
    fig = figure("underflow")
    for ax in (0, 1):
        mark, = _by_gid(fig, "underflow_at", ax)
        assert list(mark.get_xdata()) == [u["index"]] * 2
    zeros = _by_gid(fig, "zeros")  # one per panel, on twin axes
    assert len(zeros) == 2
    for line in zeros:
        xy = dict(zip(line.get_xdata(), line.get_ydata()))
        assert xy[u["index"]] == u["zeros"] > 0  # the flush the abs-max line cannot show
    assert "exact zeros in output (float16 run)" in _legend_ok(fig)


def test_a_healthy_replay_has_one_panel_and_no_culprit_mark(replays, figure):
    fig = figure("identical")
    assert len(fig.axes) == 1
    assert not [a for a in fig.axes[0].lines if a.get_gid() == "culprit"]


def _shown(text) -> tuple[str, bool]:
    """(what matplotlib draws for a Text, whether it parses it as math)."""
    return text._preprocess_math(text.get_text())


def test_names_from_files_with_dollar_signs_are_drawn_as_written_and_log_axes_keep_math_labels(tmp_path):
    from analyzer.render import write_html, write_plots

    names = [r"w$\foo$", "b$1", r"$\x$.weight", "head"]
    s = Script(n=N, n_layers=4, names=names)
    rep = build_report(s.write(tmp_path / r"run$\bar$"))
    assert len(write_plots(rep, tmp_path / "plots")) == 4  # an unknown \foo used to fail the figure
    write_html(rep, tmp_path / "r.html")
    fig = plots.plot_grad_vs_depth(rep.frames, r"run$\bar$")
    try:
        fig.canvas.draw()
        ax = fig.axes[0]
        assert _shown(ax.title) == (r"Gradient norm against depth: run$\bar$", False)
        assert [_shown(t) for t in ax.get_xticklabels()] == [(n, False) for n in names]
        assert all(_shown(t)[1] for t in ax.get_yticklabels() if t.get_text())  # 10^k on the log axis
    finally:
        plt.close(fig)

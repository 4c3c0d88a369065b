"""``analyzer replay --plot`` of an update snapshot: the figure draws the update forensics.

The snapshots are the session's real recordings of ``tests/update_runs.py`` (pure-FP16 Adam at
its default eps, clip_grad_norm_ over an inf gradient); what the figures draw is read back from
the matplotlib artists, never from PNG bytes. The hypothesis test feeds the figure forensics with
hostile numbers (what a hostile snapshot's optimizer state can put there).
"""
from __future__ import annotations

import dataclasses
import math

import matplotlib.pyplot as plt
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.cli import main
from analyzer.render.replay import replay_figure
from analyzer.render.update_plot import FACTORS
from analyzer.replay import replay_snapshot

from .test_plots import _legend_ok


def _snapshot(info: dict, reason: str):
    return next(p for p in info["snapshots"] if p.stem.endswith(f"-{reason}"))


@pytest.fixture(scope="module")
def adam(fp16_adam_eps_update_run):
    return replay_snapshot(_snapshot(fp16_adam_eps_update_run, "update"))


@pytest.fixture(scope="module")
def clip(clip_inf_update_run):
    return replay_snapshot(_snapshot(clip_inf_update_run, "update"))


@pytest.fixture
def figure():
    made = []

    def make(result):
        made.append(replay_figure(result))
        return made[-1]

    yield make
    for f in made:
        plt.close(f)


def _gid(fig, gid: str) -> list:
    return [a for ax in fig.axes for a in (*ax.lines, *ax.collections, *ax.patches, *ax.texts)
            if a.get_gid() == gid]


def _labels_at(fig, gid: str) -> set[str]:
    """The x tick labels (quantity names) under the points of the artist `gid` in the values panel."""
    ax = fig.axes[1]
    names = {round(t): lab.get_text() for t, lab in zip(ax.get_xticks(), ax.get_xticklabels())}
    found = _gid(fig, gid)
    xs = [x for a in found for x in (a.get_offsets()[:, 0] if hasattr(a, "get_offsets") else a.get_xdata())]
    return {names[round(x)] for x in xs}


def test_the_fp16_adam_update_figure_shows_the_eps_flush_bar_and_zero_state_under_nan_updates(adam, figure):
    assert adam.runs == {} and adam.update is not None  # update forensics: nothing replayed forward/backward
    fig = figure(adam)
    p = adam.update["params"][0]
    assert p["name"] == "emb.weight"
    # one bar, all eps_flush: every NaN element of the embedding is an eps that rounded to 0 in float16
    bars = _gid(fig, "factor:eps_flush")
    assert sum(b.get_width() for b in bars) == p["nonfinite"] == p["factors"]["eps_flush"] > 0
    assert not [g for g in FACTORS if g != "eps_flush" and _gid(fig, f"factor:{g}")]
    count, = _gid(fig, "count:emb.weight")
    assert f"{p['nonfinite']} of {p['numel']} NaN/Inf (float16, state float16)" in count.get_text()
    # the mechanism, exact on any CPU: exp_avg = exp_avg_sq = 0 where the NaN update landed
    assert {"exp_avg", "exp_avg_sq"} <= _labels_at(fig, "zero:emb.weight")
    assert {"update", "weight"} <= _labels_at(fig, "nonfinite:emb.weight")
    eps, = _gid(fig, "eps")
    assert eps.get_ydata()[0] == 1e-8 and eps.get_label() == "eps = 1e-08 (0 in float16)"
    assert "underflow" in fig.axes[0].get_title() and "of step 3" in fig.axes[0].get_title()
    assert "exp_avg_sq" in fig.axes[1].get_title()  # the update formula names its factors
    assert "eps = 1e-08 (0 in float16)" in _legend_ok(fig)


def test_the_clip_inf_update_figure_names_the_nan_gradient_and_the_clip_signature(clip, figure):
    fig = figure(clip)
    p = clip.update["params"][0]
    assert sum(b.get_width() for b in _gid(fig, "factor:grad")) == p["factors"]["grad"] == p["nonfinite"]
    assert {"grad", "update", "weight"} <= _labels_at(fig, "nonfinite:0.weight")
    note, = _gid(fig, "clip_signature")
    assert "clip_grad_norm_" in note.get_text()
    assert not _gid(fig, "eps")  # SGD has no eps: no line claims one
    _legend_ok(fig)


def test_a_snapshot_whose_nan_weights_the_state_explains_is_drawn_as_an_update_before_its_step(
        fp16_adam_eps_update_run, figure):
    r = replay_snapshot(_snapshot(fp16_adam_eps_update_run, "nonfinite_loss"))
    assert r.update is not None and not r.update["update_snapshot"]
    fig = figure(r)
    assert f"before step {r.step}" in fig.axes[0].get_title()
    assert sum(b.get_width() for b in _gid(fig, "factor:eps_flush")) == r.update["params"][0]["nonfinite"]


def test_an_update_result_with_no_nan_parameter_says_there_is_nothing_to_plot(adam, figure):
    empty = dataclasses.replace(adam, update={**adam.update, "params": []})
    fig = figure(empty)
    note, = _gid(fig, "nothing_to_plot")
    assert "nothing to plot" in note.get_text()
    assert len(fig.axes) == 1 and not fig.axes[0].axison


def test_replay_plot_on_the_cli_writes_the_update_figure_without_an_error(fp16_adam_eps_update_run, tmp_path):
    out = tmp_path / "update.png"
    res = CliRunner().invoke(main, ["replay", str(_snapshot(fp16_adam_eps_update_run, "update")), "--plot", str(out)])
    assert res.exit_code == 0, res.output
    assert out.stat().st_size > 0 and "update forensics" in res.output


_NUMBER = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, "nan", "inf", None]))


@st.composite
def _forensics(draw):
    params = []
    for i in range(draw(st.integers(1, 5))):
        factors = draw(st.dictionaries(st.sampled_from(list(FACTORS)), st.integers(0, 10**6), max_size=4))
        examples = draw(st.lists(st.dictionaries(st.sampled_from(["weight", "grad", "exp_avg", "update", "odd$key"]),
                                                 _NUMBER, max_size=4), max_size=5))
        eps = draw(st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.just("1e-8")))
        params.append({"name": f"p{i}$x", "dtype": "float16", "state_dtype": "float16", "numel": 10**6 + 1,
                       "nonfinite": sum(factors.values()), "factors": factors,
                       "formula": draw(st.sampled_from([None, "lr * grad"])), "eps_in_dtype": draw(_NUMBER),
                       "hyperparameters": {"eps": eps}, "examples": [{"index": [0], **e} for e in examples]})
    return {"optimizer": "Odd$Opt", "update_snapshot": draw(st.booleans()), "params": params,
            "clip_signature": draw(st.booleans())}


def _bar_sums(fig) -> dict[str, float]:
    """Per parameter name (the bar panel's y labels), the summed width of its factor bars."""
    ax = fig.axes[0]
    names = {round(t): lab.get_text().replace("\\$", "$") for t, lab in zip(ax.get_yticks(), ax.get_yticklabels())}
    out: dict[str, float] = {}
    for g in FACTORS:
        for b in _gid(fig, f"factor:{g}"):
            name = names[round(b.get_y() + b.get_height() / 2)]
            out[name] = out.get(name, 0) + b.get_width()
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(u=_forensics())
def test_any_forensics_numbers_draw_bars_that_sum_to_the_counts_and_legend_entries_that_draw(adam, u):
    fig = replay_figure(dataclasses.replace(adam, update=u))
    try:
        fig.canvas.draw()  # math text, log limits and tick labels are resolved here
        sums = _bar_sums(fig)
        for p in u["params"]:
            assert sums.get(p["name"], 0) == sum(p["factors"].values())
        lo, hi = fig.axes[1].get_ylim()
        assert math.isfinite(lo) and math.isfinite(hi) and 0 < lo < hi
        _legend_ok(fig)
    finally:
        plt.close(fig)


def test_a_forward_backward_replay_of_the_same_run_still_gets_the_per_op_figure(clip_inf_update_run, figure):
    r = replay_snapshot(_snapshot(clip_inf_update_run, "nonfinite_grads"))
    assert r.update is None and r.runs  # the gradients went inf in backward: replayed op by op
    fig = figure(r)
    assert _gid(fig, "culprit") and not _gid(fig, "nothing_to_plot")
    assert not [g for g in FACTORS if _gid(fig, f"factor:{g}")]


def test_the_autopsy_page_of_an_update_born_nan_shows_the_forensics_figure_with_its_own_caption(
        fp16_adam_eps_update_run, tmp_path):
    page = tmp_path / "autopsy.html"
    res = CliRunner().invoke(main, ["autopsy", str(fp16_adam_eps_update_run["run_dir"]), "--html", str(page)])
    assert res.exit_code == 0, res.output
    html = page.read_text()
    replay = html.split("<section id='replay'>")[1].split("</section>")[0]
    assert "data:image/png;base64," in replay
    assert "the failure is in the optimizer update" in replay and "each op's largest |output|" not in replay

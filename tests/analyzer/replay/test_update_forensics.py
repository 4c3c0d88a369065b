"""Replay's update forensics on real recorded snapshots: the NaN born in the optimizer step.

Runs come from ``tests/analyzer/report/update_models.py`` (tiny real models, real Recorder, real
faults). Nothing here mocks torch: the snapshots are the files the Recorder wrote.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from analyzer.cli import main
from analyzer.errors import AnalyzerError
from analyzer.load import load_snapshot
from analyzer.render import render_replay_text
from analyzer.replay import replay_snapshot
from analyzer.replay.update.forensics import update_applies

from ..report.update_models import clip_run, fp16_embedding_run, sgd_overflow_run, snapshots


@pytest.fixture(scope="module")
def emb_update(tmp_path_factory):
    run = fp16_embedding_run(tmp_path_factory.mktemp("emb") / "run", check_update=True)
    return run


def test_replay_of_an_fp16_adam_update_snapshot_is_underflow_in_the_optimizer_naming_the_parameter_and_eps(emb_update):
    snap = snapshots(emb_update, "update")[0]
    res = replay_snapshot(snap)
    assert res.verdict == "underflow"
    c = res.culprit
    assert c["phase"] == "optimizer" and c["module"] == "<optimizer: Adam>" and c["op"] == "adam.update"
    assert c["precision"] == "float16" and c["output_kind"] == "nan"
    assert "`emb.weight`" in res.summary and "eps = 1e-08 rounds to 0 in float16" in res.summary
    assert "forward and backward not replayed" in res.summary and res.runs == {}
    assert res.precision_mode == "parameters" and res.precision_dtype == "float16"  # model.half(), no autocast
    p = res.update["params"][0]
    # rows 8-15 never got a gradient at step 0: exp_avg = exp_avg_sq = 0, so 0/(0 + 0) = NaN on all 64
    # of their elements; a few used elements had gradients so small that exp_avg_sq flushed to 0 too
    assert p["name"] == "emb.weight" and p["eps_in_dtype"] == 0.0
    assert p["zero_over_zero"] >= 64 and p["factors"] == {"eps_flush": p["nonfinite"]}
    assert all(ex["exp_avg_sq"] == 0.0 for ex in p["examples"])


def test_replay_of_the_next_steps_snapshot_whose_weights_are_already_nan_does_the_same_forensics(emb_update):
    snap = snapshots(emb_update, "nonfinite_loss")[0]
    assert update_applies(load_snapshot(snap))
    res = replay_snapshot(snap)
    assert res.verdict == "underflow" and res.culprit["phase"] == "optimizer"
    assert "an optimizer update before step 1" in res.summary
    assert res.nonfinite_inputs == ["param:emb.weight"]


def test_clip_grad_norm_over_an_infinite_gradient_is_a_numerical_bug_named_as_clipping(tmp_path):
    run = clip_run(tmp_path / "run")
    res = replay_snapshot(snapshots(run, "update")[0])
    assert res.verdict == "numerical_bug" and res.culprit["phase"] == "optimizer"
    assert "clip_grad_norm_" in res.summary and "0 * inf = NaN" in res.summary
    assert res.update["clip_signature"] is True
    assert res.update["params"][0]["factors"] == {"grad": 1}  # gate[0]: sqrt'(0) = inf, times 0


def test_the_step_snapshot_before_the_update_with_finite_weights_is_not_routed_to_the_forensics(tmp_path):
    run = clip_run(tmp_path / "run")
    # the nonfinite_grads snapshot is taken before optimizer.step: its weights are still finite
    assert not update_applies(load_snapshot(snapshots(run, "nonfinite_grads")[0]))


def test_an_sgd_step_past_float16s_max_is_an_overflow_of_weight_plus_update(tmp_path):
    res = replay_snapshot(snapshots(sgd_overflow_run(tmp_path / "run"), "update")[0])
    assert res.verdict == "overflow" and res.culprit["module"] == "<optimizer: SGD>"
    p = res.update["params"][0]
    # 65000 + 6e4 * 0.1 = 71000 > 65504 while the update itself (6000) is finite
    assert p["factors"] == {"weight_overflow": 4} and p["formula"] == "lr * grad"


def test_an_optimizer_without_a_known_formula_lists_the_elements_and_its_state(tmp_path):
    run = fp16_embedding_run(tmp_path / "run", check_update=True, optimizer="rmsprop")
    res = replay_snapshot(snapshots(run, "update")[0])
    assert res.verdict == "numerical_bug" and res.culprit["op"] == "rmsprop.update"
    assert "no formula is known for RMSprop" in res.summary
    p = res.update["params"][0]
    assert p["formula"] is None and "square_avg" in p["state"] and p["examples"]
    assert "no formula is known" in render_replay_text(res)


def test_update_replay_json_keeps_every_existing_field_and_is_strict(emb_update):
    res = replay_snapshot(snapshots(emb_update, "update")[0])
    d = json.loads(json.dumps(res.to_dict(), allow_nan=False))
    for key in ("verdict", "summary", "culprit", "runs", "advice", "snapshot", "step", "reason", "device",
                "nonfinite_inputs", "hidden_nonfinite", "underflow_at", "context_ops", "update"):
        assert key in d
    for key in ("op", "overload", "module", "phase", "precision", "index", "source", "input_dtypes",
                "output_dtype", "input_absmax", "output_absmax", "output_kind", "custom"):
        assert key in d["culprit"]


def test_replay_cli_prints_the_update_forensics(emb_update):
    out = CliRunner().invoke(main, ["replay", str(snapshots(emb_update, "update")[0])])
    assert out.exit_code == 0, out.output
    assert "verdict: underflow" in out.output and "update forensics (Adam" in out.output
    assert "<optimizer: Adam>" in out.output


_junk = st.one_of(st.none(), st.integers(-2, 10**19), st.floats(allow_nan=True), st.text(max_size=3),
                  st.lists(st.integers(-1, 3), max_size=3), st.just((0.9, math.nan)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lr=_junk, eps=_junk, betas=_junk, step=_junk, names=_junk, scale=st.sampled_from([0.0, -1.0, math.inf]))
@example(lr=0, eps=None, betas=[], step=None, names=None, scale=0.0)  # found by hypothesis: an IndexError
@example(lr=1e-3, eps=1e-8, betas=[2, 3], step=1, names=None, scale=1.0)  # sqrt(1 - 3**1): a math domain error
@example(lr=1e-3, eps=1e-8, betas=(0.9, 1.5), step=10**19, names=None, scale=1.0)  # 1.5 ** 1e19 overflows
def test_hostile_optimizer_entries_give_a_result_or_one_analyzer_error(emb_update, tmp_path_factory, lr, eps, betas,
                                                                      step, names, scale):
    raw = torch.load(snapshots(emb_update, "update")[0], weights_only=True)
    sd = raw["optimizer"]["state_dict"]
    sd["param_groups"][0].update(lr=lr, eps=eps, betas=betas)
    for s in sd["state"].values():
        s["step"] = step
        s["exp_avg_sq"] = s["exp_avg_sq"] * scale
    if names is not None:
        raw["optimizer"]["param_names"] = names
    path = tmp_path_factory.mktemp("h") / "step00000000-r00000-update.pt"
    torch.save(raw, path)
    try:
        res = replay_snapshot(path)
    except AnalyzerError:
        return
    json.dumps(res.to_dict(), allow_nan=False)
    render_replay_text(res)


# --- the recorded runs of tests/update_runs.py -------------------------------------------------------
def test_acceptance_update_snapshot_of_the_fp16_adam_eps_run_is_underflow_naming_the_parameter_and_eps(
        fp16_adam_eps_update_run):
    info = fp16_adam_eps_update_run  # tests/conftest.py: record_fp16_adam_eps(check_update=True)
    snap = next(p for p in info["snapshots"] if p.stem.endswith("-update"))
    res = replay_snapshot(snap)
    assert res.verdict == "underflow" and res.step == info["nan_step"]
    assert res.culprit["phase"] == "optimizer" and res.culprit["module"] == "<optimizer: Adam>"
    assert "`emb.weight`" in res.summary and "eps" in res.summary


def test_acceptance_clip_inf_run_update_snapshot_names_clipping_as_where_the_nan_came_from(clip_inf_update_run):
    info = clip_inf_update_run  # tests/conftest.py: record_clip_inf(check_update=True)
    snap = next(p for p in info["snapshots"] if p.stem.endswith("-update"))
    res = replay_snapshot(snap)
    assert res.verdict == "numerical_bug" and res.step == info["nan_step"]
    assert res.culprit["module"] == "<optimizer: SGD>" and "clip_grad_norm_" in res.summary
    assert res.update["params"][0]["name"] == info["params"][0]

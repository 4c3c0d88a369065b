"""analyzer report's tiny_updates and flat_loss on real recorded runs that do not learn, and on healthy ones."""
from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main as cli
from analyzer.load import load_run
from analyzer.report.checks import CHECKS, build_frames, run_checks
from analyzer.report.checks.learning import RATIO, rule_of
from recorders import schema
from tests.sample_runs import sample_run

from .learning_runs import record

NEW = {"tiny_updates", "flat_loss"}


def _checks(run_dir) -> dict:
    return {f.check: f for f in run_checks(build_frames(load_run(run_dir)))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("learning")
    out = {}
    for name, kw in {"adamw_bug": {"scale": 1e-5}, "lr0": {"scale": 0.0}, "sgd_bug": {"opt": "sgd", "grad_divisor": 1e5},
                     "adamw": {}, "sgd": {"opt": "sgd"}, "adamw_bf16": {"amp_dtype": torch.bfloat16},
                     "sgd_bf16": {"opt": "sgd", "amp_dtype": torch.bfloat16}, "adamw_every5": {"layer_every": 5},
                     "adamw_1e-2": {"scale": 1e-2}}.items():
        out[name] = (root / name, record(root / name, **kw))
    return out


@pytest.mark.parametrize("name, optimizer", [("adamw_bug", "ScaledAdamW"), ("sgd_bug", "SGD")])
def test_a_run_whose_updates_are_orders_of_magnitude_below_the_rule_is_flagged(runs, name, optimizer):
    run_dir, losses = runs[name]
    _, lr0 = runs["lr0"]
    assert np.abs(np.array(losses) - np.array(lr0)).max() < 1e-3  # its loss is an lr = 0 run's
    found = _checks(run_dir)
    tiny = found["tiny_updates"]
    assert tiny.severity == "warning" and tiny.evidence["optimizer"] == optimizer
    names = [p["name"] for p in tiny.evidence["params"]]
    assert names == [n for n in load_run(run_dir).params]  # every parameter, in model order
    assert all(p["ratio"] < RATIO and p["rows"] >= 290 for p in tiny.evidence["params"])
    assert optimizer in tiny.message and "orders of magnitude less" in tiny.message
    flat = found["flat_loss"]
    assert flat.step == 0 and flat.evidence["steps"] == 300 and abs(flat.evidence["relative_change"]) < 0.02


def test_an_lr_0_run_is_stalled_updates_business_not_tiny_updates(runs):
    found = _checks(runs["lr0"][0])
    assert "stalled_updates" in found and "tiny_updates" not in found and "flat_loss" in found


@pytest.mark.parametrize("name", ["adamw", "sgd", "adamw_bf16", "sgd_bf16", "adamw_every5", "adamw_1e-2"])
def test_runs_that_learn_get_neither_finding(runs, name):
    run_dir, losses = runs[name]
    assert np.median(losses[-50:]) < 0.98 * np.median(losses[:50])  # it learns (at 1e-2 x lr, slowly)
    assert NEW.isdisjoint(_checks(run_dir))


def test_the_checks_are_in_the_registry_and_in_report_json(runs):
    assert NEW <= set(CHECKS)
    res = CliRunner().invoke(cli, ["report", str(runs["adamw_bug"][0]), "--json"])
    assert res.exit_code == 0, res.output
    assert NEW <= {f["check"] for f in json.loads(res.output)["findings"]}


def test_a_run_without_change_columns_or_optimizer_gets_no_tiny_updates(runs, tmp_path):
    import shutil

    dst = tmp_path / "no_optimizer"
    shutil.copytree(runs["adamw_bug"][0], dst)
    meta = json.loads((dst / schema.META_FILE).read_text())
    meta["optimizer"] = None
    (dst / schema.META_FILE).write_text(json.dumps(meta))
    assert "tiny_updates" not in _checks(dst)
    for part in (dst / schema.TRACE_DIR).glob("layers-*.parquet"):  # the columns of format 3 removed
        pl.read_parquet(part).drop("update_rms", "unchanged_frac").write_parquet(part)
    meta["format_version"] = 2
    (dst / schema.META_FILE).write_text(json.dumps(meta))
    assert "tiny_updates" not in _checks(dst)


@pytest.mark.parametrize("cls, rule", [("Adam", "adam"), ("AdamW", "adam"), ("ScaledAdamW", "adam"), ("NAdam", "adam"),
                                       ("AdamW8bit", "adam"), ("SGD", "sgd"), ("Adagrad", None), ("Adafactor", None),
                                       ("Lion", None), (None, None)])
def test_the_rule_is_known_for_sgd_and_the_adam_family_only(cls, rule):
    assert rule_of(cls) == rule


@pytest.mark.slow
@pytest.mark.parametrize("sample", ["healthy", "fp16_attention_overflow", "bf16_nan", "masked_padding",
                                    "custom_op_outside_autocast", "log_zero", "loss_outside_autocast", "stalled_layers"])
def test_no_sample_scenario_gets_a_new_finding_or_a_spike_snapshot(tmp_path_factory, sample):
    run_dir = sample_run(tmp_path_factory, sample)
    assert NEW.isdisjoint(_checks(run_dir))
    reasons = {schema.SNAPSHOT_RE.match(p.name)[4] for p in (run_dir / schema.SNAPSHOT_DIR).glob("*.pt")}
    assert reasons.isdisjoint({schema.LOSS_SPIKE, schema.GRAD_SPIKE})


def _frames(loss, lr=1e-3):
    from analyzer.report.checks import Frames

    n = len(loss)
    steps = pl.DataFrame({"step": np.arange(n), "loss": np.asarray(loss, float),
                          "lr": pl.Series([lr] * n, dtype=pl.Float64)})
    return Frames(steps=steps, layer_bins=None, params=[], numels=[], amp_dtype=None, growth_interval=2000,
                  ranks=pl.DataFrame({"rank": [0]}))


_rng = np.random.default_rng(0)
_NOISE = _rng.normal(0, 1, 400)


@pytest.mark.parametrize("loss, lr, flat", [
    (2.0 + 0.01 * _NOISE, 1e-3, True),                                 # noise around a constant
    (2.0 * (1 + 0.2 * _NOISE) * np.linspace(1, 0.95, 400), 1e-3, False),  # -5% in large noise: past FLAT_REL
    (2.0 + 0.001 * _NOISE - np.linspace(0, 0.02, 400), 1e-3, False),   # -1%, far beyond the noise
    (2.0 + 0.01 * _NOISE[:99], 1e-3, False),                           # too few steps to judge
    (2.0 + 0.01 * _NOISE, 0.0, False),                                 # lr 0: not meant to move
    (2.0 + 0.01 * _NOISE, None, False),                                # lr unknown
])
def test_flat_loss_on_scripted_step_tables(loss, lr, flat):
    from analyzer.report.checks.learning import flat_loss

    assert bool(flat_loss(_frames(loss, lr))) is flat


# -- any trace, any optimizer entry: the checks answer or stay quiet, never raise ---------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from .report_traces import healthy_traces, hostile_traces, write_trace  # noqa: E402

_HOSTILE_GROUP = st.fixed_dictionaries({
    "lr": st.sampled_from([1e-3, 0.0, -1.0, 1e-3, None, "x", True, 1e300, 5e-324]),
    "eps": st.sampled_from([1e-8, 0.0, -1e-8, None, "eps", 1e-300]),
    "params": st.sampled_from([[0, 1, 2], [None, 5, 99], [1, 0], [], [0, 0, 0], [3, 4, 5, 2]]),
})
# mostly entries the loader accepts (then the checks read them), some it refuses with one Error: line
_OPTIMIZER = st.one_of(
    st.none(), st.sampled_from(["x", [], {}]),
    *[st.fixed_dictionaries({"class": st.sampled_from(["torch.optim.adam.Adam", "torch.optim.sgd.SGD", "my.AdamW8bit",
                                                       "", "torch.optim.adagrad.Adagrad"]),
                             "param_groups": st.lists(_HOSTILE_GROUP, min_size=1, max_size=3)})] * 4)


def _with_optimizer(spec, optimizer, d):
    run = write_trace(spec, d / "run")
    for meta_path in run.glob("meta*.json"):
        meta = json.loads(meta_path.read_text())
        meta["optimizer"] = optimizer
        meta_path.write_text(json.dumps(meta))
    return run


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                 HealthCheck.function_scoped_fixture])
@given(spec=hostile_traces(), optimizer=_OPTIMIZER)
def test_the_learning_checks_never_fail_on_any_trace_and_optimizer_entry(tmp_path_factory, spec, optimizer):
    import warnings

    from analyzer.errors import AnalyzerError

    d = tmp_path_factory.mktemp("hostile")
    run = _with_optimizer(spec, optimizer, d)
    try:
        frames = build_frames(load_run(run))
    except AnalyzerError:  # the loader refuses a malformed optimizer entry with one Error: line
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no NaN arithmetic slips through
        for name in sorted(NEW):
            found = CHECKS[name](frames)
            assert all(f.check == name and f.severity == "warning" for f in found)


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                 HealthCheck.function_scoped_fixture])
@given(spec=healthy_traces(), cls=st.sampled_from(["torch.optim.adam.Adam", "torch.optim.sgd.SGD"]))
def test_healthy_generated_traces_with_an_optimizer_get_no_learning_finding(tmp_path_factory, spec, cls):
    d = tmp_path_factory.mktemp("healthy")
    opt = {"class": cls, "param_groups": [{"lr": 1e-3, "eps": 1e-8, "params": list(range(spec.n_layers))}]}
    frames = build_frames(load_run(_with_optimizer(spec, opt, d)))
    assert not [f for name in NEW for f in CHECKS[name](frames)]

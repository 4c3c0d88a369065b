"""analyzer report's update checks on real recorded runs: nonfinite_weights and stalled_updates.

The runs (``update_models``) are tiny real models trained with the Recorder; the faults are real:
Adam's eps=1e-8 rounding to 0 in float16, BF16 weights that lose every update at a small lr, and
clip_grad_norm_ over an infinite gradient.
"""
from __future__ import annotations

import json
import math
import shutil

import polars as pl

from analyzer.errors import AnalyzerError
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.report import build_report
from analyzer.report.checks import CHECK_FAILED
from analyzer.report.checks.updates import MIN_ROWS, half_ulp
from recorders import schema

from .update_models import clip_run, fp16_embedding_run, mlp_run, snapshots


def _by_check(report, check):
    return [f for f in report.findings if f.check == check]


@pytest.fixture(scope="module")
def emb_run(tmp_path_factory):
    return fp16_embedding_run(tmp_path_factory.mktemp("emb") / "run")


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    return mlp_run(tmp_path_factory.mktemp("bf16") / "run", torch.bfloat16)


def test_half_ulp_is_half_the_spacing_at_the_magnitude():
    # spacing at 1.0 is 2**-mantissa_bits: bf16 2**-7, fp16 2**-10; at 1.5 the same, at 2.0 twice that
    assert half_ulp(1.0, "bfloat16") == 2.0 ** -8
    assert half_ulp(1.5, "float16") == 2.0 ** -11
    assert half_ulp(2.0, "bfloat16") == 2.0 ** -7
    assert half_ulp(1.0, None) is None and half_ulp(float("nan"), "float16") is None


def test_nonfinite_weights_names_the_update_step_and_sorts_before_the_next_steps_nonfinite_loss(emb_run):
    rep = build_report(emb_run)
    checks = [f.check for f in rep.findings]
    assert checks.index("nonfinite_weights") < checks.index("nonfinite_loss")
    f = _by_check(rep, "nonfinite_weights")[0]
    # step 0's update made the unused rows 0/0 = NaN; param_norm (before each step) is NaN at step 1
    assert f.step == 0 and f.severity == "error"
    assert f.evidence["params"] == ["emb.weight"] and f.evidence["nonfinite_param_norm_step"] == 1
    assert "the optimizer update produced the NaN/Inf" in f.message
    assert "Adam's eps 1e-08 is 0 in float16" in f.message
    # no update snapshot in this run: the next step's snapshot, whose weights are already NaN
    assert f.evidence["snapshot"].endswith("step00000001-r00000-nonfinite_loss.pt")
    assert _by_check(rep, "nonfinite_loss")[0].step == 1
    assert rep.verdict.startswith("FAILED") and "(nonfinite_weights, step 0)" in rep.verdict


def test_nonfinite_weights_names_the_update_snapshot_when_check_update_wrote_one(tmp_path):
    run = fp16_embedding_run(tmp_path / "run", check_update=True)
    f = _by_check(build_report(run), "nonfinite_weights")[0]
    assert f.step == 0
    assert f.evidence["update_snapshot"].endswith("step00000000-r00000-update.pt")
    assert "analyzer replay" in f.message and "update.pt" in f.message


def test_an_fp16_adam_run_at_a_representable_eps_has_no_nonfinite_weights(tmp_path):
    run = fp16_embedding_run(tmp_path / "run", eps=1e-4)
    rep = build_report(run)
    assert not _by_check(rep, "nonfinite_weights") and not _by_check(rep, "nonfinite_loss")


def test_nonfinite_weights_stays_quiet_when_the_gradients_were_already_nonfinite(tmp_path):
    # clip_grad_norm_ over an infinite gradient: NaN gradients at step 0 are nonfinite_grads' finding
    rep = build_report(clip_run(tmp_path / "run"))
    assert _by_check(rep, "nonfinite_grads")[0].step == 0
    assert not _by_check(rep, "nonfinite_weights")


def test_stalled_updates_names_the_bf16_layer_whose_weights_near_one_never_change(bf16_run):
    f = _by_check(build_report(bf16_run), "stalled_updates")[0]
    assert f.severity == "warning" and f.evidence["basis"] == "unchanged_frac"
    rows = {p["name"]: p for p in f.evidence["params"]}
    p = rows["scale.weight"]
    assert p["dtype"] == "bfloat16" and p["lr"] == pytest.approx(1e-4)
    # Adam's update is ~lr = 1e-4; the weights are 1 and 2, so half an ulp is 2**-8 at their magnitude
    assert p["expected_update"] == pytest.approx(1e-4)
    assert p["half_ulp"] == 2.0 ** -8 and p["half_ulp"] > p["expected_update"]
    assert p["stalled_rows"] >= MIN_ROWS
    assert "scale.weight (bfloat16" in f.message and "FP32 master weights" in f.message
    assert "stochastic rounding" in f.message and "raise the lr" in f.message


def test_the_fp32_run_of_the_same_model_has_no_stalled_updates(tmp_path):
    rep = build_report(mlp_run(tmp_path / "run", torch.float32))
    assert not _by_check(rep, "stalled_updates") and not rep.errors


def _as_version_2(run, out):
    """The same real run as a format-2 directory: meta without the version-3 keys, layer parts
    without the version-3 columns (what an older recorder wrote)."""
    shutil.copytree(run, out)
    meta = json.loads((out / "meta.json").read_text())
    meta = {k: v for k, v in meta.items() if schema.META_KEYS_ADDED.get(k, 0) < 3}
    meta["format_version"] = 2
    (out / "meta.json").write_text(json.dumps(meta))
    for part in (out / "trace").glob("layers-*.parquet"):
        df = pl.read_parquet(part)
        df.drop([c for c, v in schema.COLUMNS_ADDED.items() if v >= 3 and c in df.columns]).write_parquet(part)
    return out


def test_stalled_updates_falls_back_to_bitwise_equal_param_norm_on_a_version_2_run(bf16_run, tmp_path):
    rep = build_report(_as_version_2(bf16_run, tmp_path / "v2"))
    f = _by_check(rep, "stalled_updates")[0]
    assert f.evidence["basis"] == "param_norm"
    assert "scale.weight" in [p["name"] for p in f.evidence["params"]]
    assert "scale.weight (bfloat16" in f.message  # meta's params carried their dtype before version 3


def test_a_version_2_fp32_run_has_no_stalled_updates(tmp_path):
    run = mlp_run(tmp_path / "run", torch.float32)
    assert not _by_check(build_report(_as_version_2(run, tmp_path / "v2")), "stalled_updates")


def test_a_version_3_run_with_exact_layer_norms_reads_and_reports_as_a_current_one(bf16_run, tmp_path):
    # format 3 differs from 4 in what param_norm and grad_zero_frac mean on healthy rows (exact there,
    # sampled since 4) and in meta.json keys added since (read as null): the same files under version 3
    # give the same report
    out = tmp_path / "v3"
    shutil.copytree(bf16_run, out)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format_version"] == schema.FORMAT_VERSION >= 4
    meta["format_version"] = 3
    (out / "meta.json").write_text(json.dumps(meta))
    new, old = build_report(bf16_run), build_report(out)
    assert [(f.check, f.step) for f in old.findings] == [(f.check, f.step) for f in new.findings]
    assert _by_check(old, "stalled_updates")[0].evidence["basis"] == "unchanged_frac"


_value = st.sampled_from([0.0, 1.0, 0.95, 1e-30, -1.0, math.nan, math.inf, -math.inf, None])
_junk = st.one_of(st.none(), st.integers(-2, 10**19), st.floats(allow_nan=True), st.text(max_size=3),
                  st.lists(st.integers(-1, 5), max_size=3))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(unch=_value, urms=_value, pnorm=_value, eps=_junk, lr=_junk, params=_junk, dtype=_junk, cls=_junk)
def test_update_checks_never_fail_on_odd_update_columns_and_optimizer_meta(bf16_run, tmp_path_factory, unch, urms,
                                                                          pnorm, eps, lr, params, dtype, cls):
    out = tmp_path_factory.mktemp("odd") / "run"
    shutil.copytree(bf16_run, out)
    meta = json.loads((out / "meta.json").read_text())
    meta["optimizer"] = {"class": cls, "param_groups": [{"lr": lr, "eps": eps, "params": params}, "x"]}
    meta["params"][1]["dtype"] = dtype
    (out / "meta.json").write_text(json.dumps(meta))
    for part in (out / "trace").glob("layers-*.parquet"):
        df = pl.read_parquet(part)
        odd = pl.col("step") % 3 == 0
        df.with_columns(unchanged_frac=pl.when(odd).then(pl.lit(unch, pl.Float32)).otherwise("unchanged_frac"),
                        update_rms=pl.when(odd).then(pl.lit(urms, pl.Float32)).otherwise("update_rms"),
                        param_norm=pl.when(odd).then(pl.lit(pnorm, pl.Float32)).otherwise("param_norm"),
                        ).write_parquet(part)
    try:
        rep = build_report(out)
    except AnalyzerError as e:  # meta.json's optimizer is validated on load: damaged is one error naming it
        assert "meta.json" in str(e)
        return
    assert CHECK_FAILED not in [f.check for f in rep.findings]
    for f in rep.findings:
        json.dumps(f.to_dict(), allow_nan=False)


# --- the recorded runs of tests/update_runs.py -------------------------------------------------------
def test_acceptance_fp16_adam_eps_run_reports_nonfinite_weights_at_the_broken_update_before_the_nan_loss(
        fp16_adam_eps_run):
    info = fp16_adam_eps_run  # tests/conftest.py: record_fp16_adam_eps(), once per session
    rep = build_report(info["run_dir"])
    checks = [f.check for f in rep.findings]
    f = _by_check(rep, "nonfinite_weights")[0]
    assert f.step == info["nan_step"] and f.evidence["params"] == info["params"]
    assert _by_check(rep, "nonfinite_loss")[0].step == info["nan_loss_step"]
    assert checks.index("nonfinite_weights") < checks.index("nonfinite_loss")
    assert "Adam's eps 1e-08 is 0 in float16" in f.message


def test_acceptance_bf16_stall_run_names_the_frozen_layer_and_the_fp32_run_stays_clean(bf16_stall_run, fp32_stall_run):
    bf16 = bf16_stall_run  # tests/conftest.py: record_bf16_stall() and record_fp32_stall(), once per session
    f = _by_check(build_report(bf16["run_dir"]), "stalled_updates")[0]
    names = [p["name"] for p in f.evidence["params"]]
    assert names == bf16["stalled"] and f.evidence["params"][0]["dtype"] == "bfloat16"
    fp32 = fp32_stall_run
    assert not _by_check(build_report(fp32["run_dir"]), "stalled_updates")

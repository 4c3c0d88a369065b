"""Every trace check on scripted traces written as real run directories (a parametrize table).

Each case starts from ``Script``'s healthy FP16 trace (normal start-up skips, ~1 skip per
growth interval, noisy loss), injects one fault at a known step, writes the run as Parquet
parts and asserts the exact set of error/warning findings the report gives.
"""
from __future__ import annotations

import numpy as np
import pytest

from analyzer.report.checks import CHECKS, build_frames, run_checks
from analyzer.report.checks.gradients import stalled_fraction
from analyzer.findings import Finding, sort_findings
from analyzer.load import load_run

from .report_models import Script


def _collapse(s: Script):
    # from step 200 every step overflows: the scale halves each step (65536 -> ~1e-56)
    for i in range(200, s.n):
        s.scale[i] = s.scale[i - 1] / 2 if i > 200 else s.scale[199]
        s.skipped[i] = True
    s.loss[200:] = np.nan


def _collapse_recovered(s: Script):
    # 16 backoffs down to 0.25, then growth back to 4096+ by the end (every 8 steps x2)
    s.scale[150:166] = 16384 / 2.0 ** np.arange(1, 17)
    s.skipped[150:166] = True
    s.scale[166:] = np.minimum(0.25 * 2.0 ** ((np.arange(s.n - 166) // 8) + 1), 16384)
    s.skipped[166:] = False


def _frequent(s: Script):
    s.skipped[100::4] = True  # 25% of steps after warm-up: ~25x the 1/100 growth interval allows


def _nan_stable(s: Script):
    s.loss[250] = np.nan  # one NaN with a stable scale: not overflow


def _nan_after_backoffs(s: Script):
    s.skipped[240:250] = True
    s.scale[240:250] = 16384 / 2.0 ** np.arange(10)
    s.scale[250:] = s.scale[249]
    s.loss[250:] = np.inf


def _spike(s: Script):
    s.loss[300:303] *= 3.0
    s.lg[298, 5] += 2.0  # blocks.2.bias: 100x at step 298, two steps before the loss spike


def _stalled_interior(s: Script):
    s.lg[:, 4:6] = -14.0 + np.random.default_rng(1).normal(0, 0.1, (s.n, 2))
    s.pnorm[:, 6] = 0.0  # a zero-init gate right after them


def _cancelled_bias(s: Script):
    # blocks.2.bias ~1e-13 while blocks.2.weight learns: a bias right before a norm or softmax
    s.lg[:, 5] = -13.0 + np.random.default_rng(3).normal(0, 0.1, s.n)


def _vanishing(s: Script):
    # 12 modules (weight+bias each): log10 norm rises 1 decade per module towards the output
    depth = np.arange(s.n_layers) // 2
    s.lg[:] = -12.5 + 1.0 * depth[None, :] + np.random.default_rng(2).normal(0, 0.1, s.lg.shape)


def _exploding_steps(s: Script):
    s.lg += np.linspace(0, 3.5, s.n)[:, None]  # total grad norm x3000 over the run


def _vanishing_steps(s: Script):
    s.lg -= np.linspace(0, 4, s.n)[:, None]


def _underflow(s: Script):
    # two 1M-element params with norm 1e-4: at scale 16384 their typical scaled element is
    # 1e-4 / 1000 * 16384 = 1.6e-3, near enough FP16's subnormals for a tail to flush to zero
    s.numels[0:2] = [1_000_000, 1_000_000]
    s.lg[:, 0:2] = -4 + np.random.default_rng(4).normal(0, 0.1, (s.n, 2))
    s.zero_frac[:, 0:2] = np.linspace(0.0, 0.7, s.n)[:, None]


def _dead_relu(s: Script):
    s.zero_frac[:, 2:4] = np.linspace(0.0, 0.4, s.n)[:, None]  # norm ~0.03 over 16 elements: not underflow


def _low_precision(s: Script):
    s.loss_dtype[:] = "float16"
    s.loss[:] = np.round(s.loss, 2)


def _down_step(s: Script):
    s.loss[200:] *= 0.5  # a sudden improvement is not a spike


def _heavy_noise(s: Script):
    s.loss *= np.random.default_rng(3).lognormal(0, 0.15, s.n)  # noisy small-batch loss


CASES = [
    # name, script kwargs, mutation, expected {(check, severity)} among errors and warnings
    ("healthy fp16 run with start-up skips", {}, None, set()),
    ("healthy bf16 run without a scaler", {"amp_dtype": "bfloat16"}, None, set()),
    ("healthy fp32 run", {"amp_dtype": None}, None, set()),
    ("noisy small-batch loss", {}, _heavy_noise, set()),
    ("a sudden drop in loss", {}, _down_step, set()),
    ("scale halves every step from step 200", {}, _collapse,
     {("scale_collapse", "error"), ("nonfinite_loss", "error")}),
    ("scale collapses then recovers", {}, _collapse_recovered, {("scale_collapse", "warning")}),
    ("a quarter of the steps skipped", {}, _frequent, {("frequent_overflow", "warning")}),
    ("one NaN loss with a stable scale", {}, _nan_stable, {("nonfinite_loss", "error")}),
    # 10 backoffs + ~2 normal skips in the 248 finite steps is 5x the 2.5 that growth_interval=100 implies
    ("Inf loss after ten backoffs", {}, _nan_after_backoffs,
     {("nonfinite_loss", "error"), ("frequent_overflow", "warning")}),
    ("NaN loss in bf16", {"amp_dtype": "bfloat16"}, _nan_stable, {("nonfinite_loss", "error")}),
    ("loss triples for three steps", {}, _spike, {("loss_spike", "warning")}),
    ("two interior params at 1e-14", {}, _stalled_interior, {("stalled_layers", "warning")}),
    # the output gradient sums to ~0 (cancelled by what follows): redundant, reported as info only
    ("a bias stalled while its weight learns", {}, _cancelled_bias, set()),
    ("gradient shrinks 10x per module towards the input", {"n_layers": 24}, _vanishing,
     {("vanishing_gradients", "warning"), ("stalled_layers", "warning")}),
    ("gradient norm grows 3.5 decades over the run", {}, _exploding_steps, {("exploding_gradients", "warning")}),
    ("gradient norm falls 4 decades over the run", {}, _vanishing_steps, {("vanishing_gradients", "warning")}),
    ("zero fraction of two fp16 params rises to 0.7", {}, _underflow, {("grad_underflow", "warning")}),
    ("zero fraction rises in a bf16 run", {"amp_dtype": "bfloat16"}, _underflow, set()),
    ("zero fraction rises where gradients are large (dead ReLUs)", {}, _dead_relu, set()),
    ("loss tensor was float16", {}, _low_precision, {("low_precision_loss", "warning")}),
]


def _findings(tmp_path, kwargs, mutate) -> tuple[list[Finding], Script]:
    s = Script(**kwargs)
    if mutate:
        mutate(s)
    s.write(tmp_path / "run")
    return run_checks(build_frames(load_run(tmp_path / "run"))), s


@pytest.mark.parametrize("name,kwargs,mutate,expected", CASES, ids=[c[0] for c in CASES])
def test_each_check_finds_exactly_its_scripted_fault(tmp_path, name, kwargs, mutate, expected):
    findings, _ = _findings(tmp_path, kwargs, mutate)
    got = {(f.check, f.severity) for f in findings if f.severity in ("error", "warning")}
    assert got == expected, [f.message for f in findings]
    assert all(f.check in CHECKS for f in findings)


def test_scale_collapse_starts_where_the_descent_starts(tmp_path):
    findings, s = _findings(tmp_path, {}, _collapse)
    f = next(f for f in findings if f.check == "scale_collapse")
    # step 200 still uses the plateau scale and overflows; 201 is the first halved scale,
    # so the falling scale starts at step 200
    assert f.step == 200 and f.evidence["scale_start"] == s.scale[199]
    assert f.evidence["min_scale"] < 1 and not f.evidence["recovered"]
    assert f.evidence["skipped_after_start"] >= 199  # steps 200..399 all skipped


@pytest.mark.parametrize("stop_at_one", [False, True])
def test_scale_collapse_message_counts_the_backoffs_to_1_and_names_the_minimum_separately(tmp_path, stop_at_one):
    def collapse(s: Script):
        _collapse(s)
        if stop_at_one:  # the scaler stops halving once the scale reaches 1
            s.scale[s.scale < 1] = 1.0

    findings, s = _findings(tmp_path, {}, collapse)
    ev = next(f for f in findings if f.check == "scale_collapse").evidence
    msg = next(f for f in findings if f.check == "scale_collapse").message
    # halving from the plateau scale reaches exactly 1 after log2(scale) backoffs
    assert ev["scale_reached"] == 1.0 and ev["backoffs"] == int(np.log2(s.scale[199]))
    head = f"fell from {s.scale[199]:g} to 1 in {ev['backoffs']} backoffs by step {ev['step_reached']}"
    assert head in msg
    assert (f", then to {ev['min_scale']:.3g}," in msg) == (not stop_at_one)


def test_nonfinite_loss_with_stable_scale_says_not_overflow_and_names_the_snapshot(tmp_path):
    s = Script()
    _nan_stable(s)
    run = s.write(tmp_path / "run")
    snap = run / "snapshots" / "step00000250-r00000-nonfinite_loss.pt"
    snap.parent.mkdir()
    snap.write_bytes(b"")  # only its name is read by the report
    f = next(f for f in run_checks(build_frames(load_run(run))) if f.check == "nonfinite_loss")
    assert f.step == 250 and "not a gradient overflow" in f.message and str(snap) in f.message
    assert f.evidence["skipped_before"] <= 1 and f.evidence["scale_fell_before"] is False


def test_nonfinite_loss_after_backoffs_blames_overflow(tmp_path):
    findings, _ = _findings(tmp_path, {}, _nan_after_backoffs)
    f = next(f for f in findings if f.check == "nonfinite_loss")
    # the 10 injected backoffs, plus at most the one periodic skip of the healthy rhythm
    assert f.step == 250 and "FP16 overflow" in f.message and f.evidence["skipped_before"] in (10, 11)


def test_bf16_nan_is_called_a_numerical_problem(tmp_path):
    findings, _ = _findings(tmp_path, {"amp_dtype": "bfloat16"}, _nan_stable)
    f = next(f for f in findings if f.check == "nonfinite_loss")
    assert "BF16" in f.message and "numerical problem" in f.message


def test_loss_spike_names_the_layer_whose_grad_norm_moved_first(tmp_path):
    findings, s = _findings(tmp_path, {}, _spike)
    f = next(f for f in findings if f.check == "loss_spike")
    assert f.step == 300
    moved = f.evidence["moved_first"]
    assert moved["layer"] == s.names[5] == "blocks.2.bias" and moved["step"] == 298
    assert 50 < moved["grad_norm_ratio"] < 200  # +2 decades injected: ~100x its baseline


def test_stalled_interior_layers_are_named_with_the_near_zero_gate(tmp_path):
    findings, s = _findings(tmp_path, {}, _stalled_interior)
    f = next(f for f in findings if f.check == "stalled_layers")
    assert f.evidence["layers"] == ["blocks.2.weight", "blocks.2.bias"]
    assert f.evidence["location"] == "interior" and "blocks.3.weight" in f.evidence["near_zero_params"]
    # 2 of 8 params of equal size are stalled on every step: a quarter of the parameters
    assert f.evidence["param_fraction_stalled"]["mean"] == pytest.approx(0.25)


def test_vanishing_through_depth_names_the_early_layers(tmp_path):
    findings, s = _findings(tmp_path, {"n_layers": 24}, _vanishing)
    stalled = next(f for f in findings if f.check == "stalled_layers")
    assert stalled.evidence["location"] == "early"
    # module d has log10 norm -12.5+d (noise sd 0.1): modules 0..3 (10^-12.5..10^-9.5) are below
    # the absolute 1e-9 on every step, module 4 (10^-8.5) is above it and within 4 decades of
    # the median (-7): exactly blocks.0 .. blocks.3, weight and bias, are stalled
    assert stalled.evidence["layers"] == [f"blocks.{d}.{k}" for d in range(4) for k in ("weight", "bias")]
    van = next(f for f in findings if f.check == "vanishing_gradients")
    assert van.evidence["slope_decades_per_module"] == pytest.approx(1.0, abs=0.05)
    assert van.evidence["p_value"] < 1e-6


def test_stalled_fraction_over_time_is_bounded_and_per_bin(tmp_path):
    s = Script()
    _stalled_interior(s)
    frames = build_frames(load_run(s.write(tmp_path / "run")))
    sf = stalled_fraction(frames)
    assert sf.height == 400 and sf["frac"].min() == pytest.approx(0.25) and sf["frac"].max() == pytest.approx(0.25)


def test_frequent_overflow_excludes_start_up_skips_and_uses_the_growth_interval(tmp_path):
    findings, s = _findings(tmp_path, {}, _frequent)
    f = next(f for f in findings if f.check == "frequent_overflow")
    assert f.evidence["startup_skips"] == 2  # 65536 and 32768 overflow; 16384 is below the safe scale
    assert f.evidence["growth_interval"] == 100 and f.evidence["binomial_p"] < 1e-10


def test_a_long_growth_interval_makes_the_same_skips_frequent(tmp_path):
    # 5 skips in 400 steps is normal at growth_interval=100 but 25x too many at 2000 (torch default)
    s = Script()
    s.skipped[[120, 180, 240, 300, 360]] = True
    s.write(tmp_path / "a")
    meta_path = tmp_path / "a" / "meta.json"
    assert not [f for f in run_checks(build_frames(load_run(tmp_path / "a"))) if f.check == "frequent_overflow"]
    import json

    meta = json.loads(meta_path.read_text())
    meta["scaler"]["growth_interval"] = 2000
    meta_path.write_text(json.dumps(meta))
    assert [f.check for f in run_checks(build_frames(load_run(tmp_path / "a"))) if f.severity != "info"] \
        == ["frequent_overflow"]


def test_the_start_up_skips_are_named_gradscaler_calibration_and_are_not_an_error(tmp_path):
    s = Script()  # 65536 and 32768 overflow at steps 0 and 1; 16384 fits
    findings = run_checks(build_frames(load_run(s.write(tmp_path / "run"))))
    [cal] = [f for f in findings if f.check == "startup_calibration"]
    assert (cal.severity, cal.step) == ("info", 0)
    assert cal.evidence["last_step"] == 1 and cal.evidence["settled_scale"] == 16384.0
    assert cal.evidence["backoffs"] == 2
    assert cal.message.startswith("steps 0-1 were skipped while GradScaler backed off from 65536 to 16384 in 2 "
                                  "backoffs before its first finite step: GradScaler's start-up calibration")
    # what this run measured (steps 0 and 1 overflowed at 65536 and 32768), no claim about the default
    assert "(this run's scaled gradients overflowed at every scale from 65536 down to 32768)" in cal.message
    assert "above FP16's max" not in cal.message and cal.evidence["last_skipped_scale"] == 32768.0
    assert not [f for f in findings if f.severity != "info"]


def test_leading_skips_that_reach_a_scale_of_one_are_a_collapse_not_calibration(tmp_path):
    s = Script()
    s.skipped[:] = True  # every step overflows from the start: 65536 halves past 1 by step 17
    s.scale[:] = 65536.0 / 2.0 ** np.arange(s.n)
    findings = run_checks(build_frames(load_run(s.write(tmp_path / "run"))))
    assert not [f for f in findings if f.check == "startup_calibration"]
    [col] = [f for f in findings if f.check == "scale_collapse"]
    assert col.severity == "error" and "every one of the" in col.message and "overflow even unscaled" in col.message


def test_findings_are_strict_json(tmp_path):
    import json

    findings, _ = _findings(tmp_path, {}, _nan_after_backoffs)
    text = json.dumps([f.to_dict() for f in findings], allow_nan=False)
    assert '"loss": "inf"' in text


def test_finding_rejects_unknown_severity():
    with pytest.raises(ValueError, match="severity"):
        Finding("x", "fatal", 1, "m")


def test_light_statistics_match_scipy_stats():
    from scipy import stats as ref

    from analyzer.report.checks import _stats

    rng = np.random.default_rng(0)
    x = np.arange(40.0)
    y = 0.05 * x + rng.normal(0, 1, 40)
    got, want = _stats.linregress(x, y), ref.linregress(x, y)
    assert got.slope == pytest.approx(want.slope) and got.pvalue == pytest.approx(want.pvalue, rel=1e-6)
    assert _stats.binom_sf(13, 398, 0.01) == pytest.approx(
        ref.binomtest(13, 398, 0.01, alternative="greater").pvalue, rel=1e-6)
    ties = np.array([1, 2, 2, 3, 5, 5, 5, 8.0])
    assert _stats.spearman(ties, y[:8]) == pytest.approx(ref.spearmanr(ties, y[:8]).statistic)


@pytest.mark.parametrize("df", [1, 2, 7, 38, 1999, 200_000])
@pytest.mark.parametrize("t", [0.0, 0.3, 1.0, 2.5, 6.0, 40.0])
def test_the_t_test_p_value_matches_scipy_without_importing_it(df, t):
    from scipy import special

    from analyzer.report.checks import _stats

    # two-sided: the statistic _stats.linregress turns into its slope's p-value
    want = float(2 * special.stdtr(df, -t))
    assert _stats._betainc(df / 2.0, 0.5, df / (df + t * t)) == pytest.approx(want, rel=1e-8, abs=1e-300)


@pytest.mark.parametrize("k,n,p", [(0, 10, 0.3), (1, 1, 0.5), (5, 10, 0.5), (13, 398, 0.01), (400, 100_000, 0.004),
                                   (60, 1000, 0.01), (999, 1000, 0.999), (11, 10, 0.2)])
def test_the_binomial_tail_matches_scipy(k, n, p):
    from scipy import special

    from analyzer.report.checks import _stats

    want = float(special.bdtrc(k - 1, n, p)) if k > 0 else 1.0
    assert _stats.binom_sf(k, n, p) == pytest.approx(want, rel=1e-8, abs=1e-300)


def test_a_bias_cancelled_by_what_follows_is_info_not_a_stall(tmp_path):
    findings, _ = _findings(tmp_path, {}, _cancelled_bias)
    info = [f for f in findings if f.check == "stalled_layers"]
    # blocks.2.weight (layer 4) learns normally, so blocks.2.bias (layer 5) is a cancelled shift
    assert [(f.severity, f.evidence["layers"]) for f in info] == [("info", ["blocks.2.bias"])]
    assert "redundant" in info[0].message


def _bad_grads(s: Script, step: int = 120, layers=(2, 3)):
    """Gradients of `layers` non-finite at `step` with a finite loss; the loss NaN from the next step."""
    s.nonfinite = np.where(s.skipped, 10, 0)
    s.nonfinite[step] = 7
    s.layer_nonfinite[step, list(layers)] = [3, 4]
    s.lg[step, list(layers)] = np.nan
    s.loss[step + 1:] = np.nan


@pytest.mark.parametrize("kwargs,needle", [
    ({"amp_dtype": "bfloat16"}, "in BF16 (FP32's range) any NaN/Inf is a real numerical bug"),
    ({"amp_dtype": None}, "in FP32 any NaN/Inf is a real numerical bug"),
    ({"amp_dtype": "float16", "scaler": False}, "an unscaled FP16 backward can overflow"),
], ids=["bf16", "fp32", "fp16 without a scaler"])
def test_nonfinite_grads_under_a_finite_loss_names_step_and_params_in_model_order(tmp_path, kwargs, needle):
    s = Script(**kwargs)
    _bad_grads(s)
    findings, _ = _findings_of(tmp_path, s)
    f = next(f for f in findings if f.check == "nonfinite_grads")
    assert (f.severity, f.step) == ("error", 120) and needle in f.message
    assert f.evidence["params"] == ["blocks.1.weight", "blocks.1.bias"] and f.evidence["nearest_output"] == "blocks.1.bias"
    assert f.evidence["loss_finite"] is True and f.evidence["first_nonfinite_loss_step"] == 121
    assert sort_findings(findings)[0].check == "nonfinite_grads"  # before the loss went NaN: the verdict's


def test_nonfinite_grads_on_a_step_the_gradscaler_skipped_is_left_to_the_scaler_checks(tmp_path):
    s = Script()
    loss = s.loss.copy()
    _bad_grads(s, step=int(np.flatnonzero(s.skipped)[0]))  # a start-up overflow: skipped, loss finite
    s.loss[:] = loss  # and the loss stays finite afterwards: the scaler absorbed the step
    findings, _ = _findings_of(tmp_path, s)
    assert not [f for f in findings if f.check == "nonfinite_grads"]


def test_nonfinite_grads_on_a_step_the_gradscaler_did_not_skip_says_so(tmp_path):
    s = Script()
    _bad_grads(s, step=150)
    assert not s.skipped[150]
    findings, _ = _findings_of(tmp_path, s)
    f = next(f for f in findings if f.check == "nonfinite_grads")
    assert f.step == 150 and "did not skip this step" in f.message and f.evidence["scaler"] is True


def _findings_of(tmp_path, s: Script):
    s.write(tmp_path / "run")
    return run_checks(build_frames(load_run(tmp_path / "run"))), s

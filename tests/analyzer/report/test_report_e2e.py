"""``analyzer report`` end to end on runs recorded by the real Recorder (tiny models, CPU)."""
from __future__ import annotations

import json
import math

import polars as pl
import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main
from analyzer.report import build_report

from . import report_models as rm

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _checks(rep, *severities):
    return {f.check for f in rep.findings if f.severity in severities}


@pytest.fixture(scope="module")
def attn_run(tmp_path_factory):
    # attention logits not divided by sqrt(d) and Adam at lr=1.0: the logits pass 65504 by
    # step ~13 and every later step overflows; the scale halves each step (measured: below 1
    # by step ~30 and at 1e-7 by step 45)
    kw = dict(vocab=16, d=32, gain=1.0)
    return rm.train_recorded(tmp_path_factory.mktemp("attn") / "run", model=rm.build_attn(**kw),
                             factory="tests.analyzer.report.report_models:build_attn", factory_kwargs=kw,
                             loss_fn=rm.attn_loss, steps=50, amp_dtype=torch.float16, lr=1.0, kind="tokens")


def test_fp16_attention_overflow_gives_scale_collapse_and_names_the_snapshot(attn_run):
    rep = build_report(attn_run)
    assert "scale_collapse" in _checks(rep, "error") and "nonfinite_loss" in _checks(rep, "error")
    sc = next(f for f in rep.findings if f.check == "scale_collapse")
    assert sc.evidence["min_scale"] < 1 and not sc.evidence["recovered"]
    nf = next(f for f in rep.findings if f.check == "nonfinite_loss")
    assert rep.frames.snapshots and nf.evidence["snapshot"] == rep.frames.snapshots[0]["file"]
    assert "analyzer replay" in nf.message and rep.verdict.startswith("FAILED")


def test_deep_sigmoid_mlp_with_small_init_names_the_early_layers(tmp_path):
    kw = dict(depth=10, width=16, init_std=0.02)
    run = rm.train_recorded(tmp_path / "run", model=rm.build_sigmoid_mlp(**kw),
                            factory="tests.analyzer.report.report_models:build_sigmoid_mlp", factory_kwargs=kw,
                            loss_fn=rm.mlp_loss, steps=40, amp_dtype=torch.float16, lr=1e-3)
    rep = build_report(run)
    f = next(f for f in rep.findings if f.check == "stalled_layers")
    # sigmoid' <= 0.25 times weights of std 0.02 (x sqrt(16)): ~0.02 per layer, so the first
    # Linear layers get gradients that round to zero in FP16; the stalled ones are a prefix
    assert f.evidence["location"] == "early" and f.evidence["layers"][:2] == ["0.weight", "0.bias"]
    assert "vanishing_gradients" in _checks(rep, "warning")
    assert not _checks(rep, "error")


def test_loss_outside_autocast_gives_low_precision_loss(tmp_path):
    kw = dict(width=16)
    run = rm.train_recorded(tmp_path / "run", model=rm.build_small_mlp(**kw),
                            factory="tests.analyzer.report.report_models:build_small_mlp", factory_kwargs=kw,
                            loss_fn=rm.mlp_loss, steps=30, amp_dtype=torch.float16, lr=1e-3,
                            outside_autocast=True)
    rep = build_report(run)
    f = next(f for f in rep.findings if f.check == "low_precision_loss")
    assert f.evidence["loss_dtype"] == "float16" and f.evidence["steps"] == 30


def test_a_bias_before_batchnorm_is_reported_as_redundant_not_as_a_stall(tmp_path):
    kw = dict(width=16)
    run = rm.train_recorded(tmp_path / "run", model=rm.build_bn_mlp(**kw),
                            factory="tests.analyzer.report.report_models:build_bn_mlp", factory_kwargs=kw,
                            loss_fn=rm.mlp_loss, steps=60, amp_dtype=None, lr=3e-3)
    rep = build_report(run)
    assert not _checks(rep, "error", "warning"), [f.message for f in rep.findings]
    info = next(f for f in rep.findings if f.check == "stalled_layers")
    # BatchNorm removes the batch mean of its input, so the Linear biases feeding it (0.bias,
    # 3.bias) get gradients at rounding level while their weights learn
    assert info.severity == "info" and set(info.evidence["layers"]) == {"0.bias", "3.bias"}


@pytest.mark.parametrize("amp", [torch.float16, torch.bfloat16, None], ids=["fp16", "bf16", "fp32"])
def test_healthy_recorded_run_has_no_errors_or_warnings(tmp_path, amp):
    kw = dict(width=16)
    run = rm.train_recorded(tmp_path / "run", model=rm.build_small_mlp(**kw),
                            factory="tests.analyzer.report.report_models:build_small_mlp", factory_kwargs=kw,
                            loss_fn=rm.mlp_loss, steps=120, amp_dtype=amp, lr=3e-3)
    rep = build_report(run)
    assert not _checks(rep, "error", "warning"), [f.message for f in rep.findings]
    assert rep.verdict.startswith("healthy")


# --------------------------------------------------------------------------- one real run per check
# Each fault is driven by a mechanism that does not hinge on FP16 rounding luck (an exact zero, a
# 1e30 that no FP16 kernel can hold, an identity design matrix, a loss weight falling 9 decades),
# so the same steps come out under ATEN_CPU_CAPABILITY=default, avx2 and avx512. Session-scoped:
# each run is trained once however many tests read it.
_R = "tests.analyzer.report.report_models:"


@pytest.fixture(scope="session")
def sqrt_bf16_run(tmp_path_factory):
    # step 12's batch has an all-zero first row: sqrt(sum(h*h)) at 0, a finite forward and loss,
    # and 0/0 = NaN in backward (see report_models._SqrtNorm); Adam then poisons proj.weight
    data = rm.batches("vectors", 20)
    data[12]["x"][0] = 0.0
    return rm.train_recorded(tmp_path_factory.mktemp("sqrt") / "run", model=rm.build_sqrt_norm(16),
                             factory=_R + "build_sqrt_norm", factory_kwargs={"width": 16}, loss_fn=rm.mlp_loss,
                             steps=20, amp_dtype=torch.bfloat16, lr=3e-3, data=data)


def test_bf16_gradients_that_go_nan_under_a_finite_loss_give_nonfinite_grads(sqrt_bf16_run):
    rep = build_report(sqrt_bf16_run)
    f = next(f for f in rep.findings if f.check == "nonfinite_grads")
    # only proj.weight: inp's gradient is cut by ReLU at 0 and head's input row is 0 (see _SqrtNorm)
    assert (f.severity, f.step, f.evidence["params"]) == ("error", 12, ["proj.weight"])
    assert f.evidence["loss_finite"] is True and f.evidence["first_nonfinite_loss_step"] == 13
    assert f.evidence["snapshot"].endswith("step00000012-r00000-nonfinite_grads.pt")
    assert "BF16" in f.message and "numerical bug" in f.message
    assert [x.step for x in rep.findings if x.check == "nonfinite_loss"] == [13]
    # the gradients broke one step before the loss did: the verdict names them
    assert rep.verdict.startswith("FAILED: the gradients of 1 parameter(s) went non-finite at step 12")


@pytest.fixture(scope="session")
def broken_from_step0_run(tmp_path_factory):
    # the first layer's weights x1e6: its FP16 outputs pass 65504 on every batch from step 0
    # (inputs ~N(0,1), 16 of them: ~1e6 per output, 15x FP16's max), so no step is ever finite
    model = rm.build_small_mlp(16)
    with torch.no_grad():
        model[0].weight.mul_(1e6)
    return rm.train_recorded(tmp_path_factory.mktemp("step0") / "run", model=model,
                             factory=_R + "build_small_mlp", factory_kwargs={"width": 16}, loss_fn=rm.mlp_loss,
                             steps=30, amp_dtype=torch.float16, lr=1e-3)


def test_a_run_nonfinite_from_step_0_reports_without_crashing(broken_from_step0_run):
    res = CliRunner().invoke(main, ["report", str(broken_from_step0_run), "--json"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout, parse_constant=lambda c: pytest.fail(f"non-strict JSON literal {c}"))
    nf = next(f for f in obj["findings"] if f["check"] == "nonfinite_loss")
    assert nf["step"] == 0 and "first step with a recorded loss" in nf["message"]
    assert nf["evidence"]["snapshot"].endswith("step00000000-r00000-nonfinite_loss.pt")
    assert obj["steps"]["nonfinite_loss"] == 30 and obj["verdict"].startswith("FAILED: the loss became nan at step 0")
    assert "scale_collapse" in {f["check"] for f in obj["findings"]}


@pytest.fixture(scope="session")
def padded_overflow_run(tmp_path_factory):
    # every 5th step from 20, one padding row (label -100, ignored by cross_entropy) holds 1e30:
    # autocast's FP16 cast makes it inf, the row's logits NaN; the loss ignores the row and stays
    # finite, backward does not: NaN gradients, so the GradScaler skips exactly those 10 steps
    data = rm.batches("vectors", 70)
    for i in range(20, 70, 5):
        data[i]["x"][0], data[i]["y"][0] = 1e30, -100
    return rm.train_recorded(tmp_path_factory.mktemp("overflow") / "run", model=rm.build_small_mlp(16),
                             factory=_R + "build_small_mlp", factory_kwargs={"width": 16}, loss_fn=rm.mlp_loss,
                             steps=70, amp_dtype=torch.float16, lr=3e-3, data=data)


def test_padding_rows_that_overflow_fp16_every_fifth_step_give_frequent_overflow(padded_overflow_run):
    rep = build_report(padded_overflow_run)
    assert _checks(rep, "error", "warning") == {"frequent_overflow"}, [f.message for f in rep.findings]
    f = next(f for f in rep.findings if f.check == "frequent_overflow")
    # 10 injected steps, no start-up skip (this MLP's scaled gradients stay ~10x below 65504)
    assert (f.step, f.evidence["skipped"], f.evidence["steps"]) == (20, 10, 70)
    assert rep.frames.steps.filter(pl.col("skipped"))["step"].to_list() == list(range(20, 70, 5))


@pytest.fixture(scope="session")
def spike_run(tmp_path_factory):
    # step 65's batch: inputs x5 and every label moved to the next class: confidently wrong
    data = rm.batches("vectors", 80)
    data[65]["x"], data[65]["y"] = data[65]["x"] * 5, (data[65]["y"] + 1) % 4
    return rm.train_recorded(tmp_path_factory.mktemp("spike") / "run", model=rm.build_small_mlp(16),
                             factory=_R + "build_small_mlp", factory_kwargs={"width": 16}, loss_fn=rm.mlp_loss,
                             steps=80, amp_dtype=None, lr=3e-3, data=data)


def test_a_batch_of_wrong_labels_gives_a_loss_spike_at_its_step(spike_run):
    rep = build_report(spike_run)
    assert _checks(rep, "error", "warning") == {"loss_spike"}, [f.message for f in rep.findings]
    f = next(f for f in rep.findings if f.check == "loss_spike")
    assert f.step == 65 and f.evidence["first"][0]["loss"] > 2 * f.evidence["first"][0]["baseline"]


@pytest.fixture(scope="session")
def diverging_sgd_run(tmp_path_factory):
    # least squares on an identity design (16 rows): loss = mean((w - y)^2), Hessian I/8, so SGD at
    # lr=17.6 multiplies the error, and the gradient, by 1 - 17.6/8 = -1.2 every step; every product
    # with the identity is exact, so the numbers do not depend on the kernel
    data = [{"x": torch.eye(16), "y": torch.ones(16)} for _ in range(50)]
    return rm.train_recorded(tmp_path_factory.mktemp("explode") / "run", model=rm.build_regression(16),
                             factory=_R + "build_regression", factory_kwargs={"width": 16}, loss_fn=rm.mse_loss,
                             steps=50, amp_dtype=None, lr=17.6, data=data, sgd=True)


def test_sgd_with_too_high_a_learning_rate_gives_exploding_gradients(diverging_sgd_run):
    rep = build_report(diverging_sgd_run)
    assert _checks(rep, "error", "warning") == {"exploding_gradients"}, [f.message for f in rep.findings]
    f = next(f for f in rep.findings if f.check == "exploding_gradients")
    # x1.2 per step over 49 steps: 49 * log10(1.2) = 3.88 decades; the first step 1 decade above the
    # first quarter's median (steps 0..11, i.e. step 5.5) is 5.5 + 1 / log10(1.2) = 18.1 -> 19
    assert f.evidence["change_decades"] == pytest.approx(49 * math.log10(1.2), abs=1e-3) and f.step == 19


@pytest.fixture(scope="session")
def underflow_run(tmp_path_factory):
    # FP16 without a GradScaler and a loss weight falling from 1 to 1e-9 over 60 steps: the FP16
    # gradient of the logits (~1e-2 x weight) passes below FP16's smallest subnormal (6e-8) halfway
    data = rm.batches("vectors", 60)
    for i, b in enumerate(data):
        b["weight"] = torch.tensor(10.0 ** (-i * 9 / 60))
    return rm.train_recorded(tmp_path_factory.mktemp("underflow") / "run", model=rm.build_small_mlp(16),
                             factory=_R + "build_small_mlp", factory_kwargs={"width": 16},
                             loss_fn=rm.weighted_mlp_loss, steps=60, amp_dtype=torch.float16, lr=3e-3,
                             data=data, scaler=False)


def test_fp16_gradients_shrinking_below_its_subnormals_give_grad_underflow(underflow_run):
    rep = build_report(underflow_run)
    # the total gradient norm falls 9 decades with the weight: vanishing_gradients says so too
    assert _checks(rep, "error", "warning") == {"grad_underflow", "vanishing_gradients"}, \
        [f.message for f in rep.findings]
    f = next(f for f in rep.findings if f.check == "grad_underflow")
    assert f.severity == "warning" and "4.weight" in f.evidence["layers"]
    assert f.evidence["overall_zero_fraction"]["first"] < 0.1 < 0.5 < f.evidence["overall_zero_fraction"]["last"]


def test_cli_report_writes_plots_and_html_for_a_recorded_run(attn_run, tmp_path):
    res = CliRunner().invoke(main, ["report", str(attn_run), "--plots", str(tmp_path / "p"),
                                    "--html", str(tmp_path / "r.html")])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[1].startswith("Verdict: FAILED")
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        "grad_heatmap.png", "grad_vs_depth.png", "loss_scale.png", "stalled_fraction.png"]
    page = (tmp_path / "r.html").read_text()
    assert "scale_collapse" in page and "snapshots/step" in page

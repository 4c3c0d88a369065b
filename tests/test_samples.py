"""End to end, per sample scenario: train it (CPU, recorder on), then check what report and replay conclude.

Each scenario's docstring explains its bug; the expectations below are pinned against it. The
scenarios seed themselves and train on one thread. Every failing step is pinned exactly: each
failure is built from a mechanism that does not hinge on FP16 rounding (a corrupted record or a
temperature jump at a known step), so the same steps come out whatever SIMD the CPU has
(``.ci/run`` runs these tests again under ``ATEN_CPU_CAPABILITY=default``). Each scenario is
trained once per session (``tests.sample_runs``) and only read here.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from analyzer.replay import replay_snapshot
from analyzer.report import build_report
from samples import bf16_nan, custom_op_outside_autocast, fp16_attention_overflow, log_zero, masked_padding
from samples._common import snapshots_of
from tests.sample_runs import sample_run

pytestmark = pytest.mark.slow


def _findings(run_dir: Path) -> dict[str, dict]:
    """check name -> the first finding of that check, as a dict."""
    out: dict[str, dict] = {}
    for f in build_report(run_dir).to_dict()["findings"]:
        out.setdefault(f["check"], f)
    return out


def _serious(findings: dict[str, dict]) -> set[str]:
    return {name for name, f in findings.items() if f["severity"] in ("error", "warning")}


def _replay_first(run_dir: Path, dtypes=None) -> dict:
    snaps = snapshots_of(run_dir)
    assert snaps, f"no snapshot in {run_dir}"
    return replay_snapshot(snaps[0], device="cpu", dtypes=dtypes).to_dict()


def test_fp16_attention_overflow_fails_at_the_temperature_jump_collapses_the_scale_and_replays_as_a_forward_overflow(
        tmp_path_factory):
    run_dir = sample_run(tmp_path_factory, "fp16_attention_overflow")
    findings = _findings(run_dir)
    bad, steps = fp16_attention_overflow.BAD_STEP, fp16_attention_overflow.STEPS
    # The temperature drops to 1e-5 at BAD_STEP: the logits jump 100,000x, from a few units past
    # 65504, so the first NaN is that step on any CPU, and nothing was skipped before it.
    nonfinite = findings["nonfinite_loss"]
    assert nonfinite["step"] == bad
    assert nonfinite["evidence"]["scale_fell_before"] is False
    assert nonfinite["evidence"]["skipped_before"] == 0
    assert nonfinite["evidence"]["nonfinite_steps"] == steps - bad  # the temperature stays down
    assert snapshots_of(run_dir)[0].name.startswith(f"step{bad:08d}-")
    # Every step from BAD_STEP on overflows and is skipped, so the scale halves on each one:
    # 4096 (INIT_SCALE) reaches 1 after 12 backoffs; the last step records the scale it ran at,
    # before its own backoff: 4096 / 2**35.
    collapse = findings["scale_collapse"]
    assert collapse["severity"] == "error"
    assert collapse["step"] == bad
    ev = collapse["evidence"]
    assert (ev["step_reached"], ev["backoffs"]) == (bad + 12, 12)
    assert ev["skipped_after_start"] == ev["longest_skip_streak"] == steps - bad
    assert ev["final_scale"] == fp16_attention_overflow.INIT_SCALE / 2.0 ** (steps - bad - 1)

    result = _replay_first(run_dir, dtypes=["fp32", "fp16", "bf16"])
    # The unscaled q @ k^T is the first op whose FP16 output is inf from finite inputs; its FP32
    # value is above 65504, and FP32 / BF16 (FP32's range) replays of the step stay finite.
    assert result["verdict"] == "overflow"
    culprit = result["culprit"]
    assert culprit["op"].startswith("aten.bmm")
    assert culprit["module"] == "blocks.0.attn"  # the first attention the logits reach
    assert culprit["phase"] == "forward"
    assert culprit["precision"] == "float16"
    assert result["runs"]["float32"]["finite"] and result["runs"]["bfloat16"]["finite"]
    assert not result["runs"]["float16"]["finite"]


def test_the_same_unscaled_attention_trains_without_nan_in_bf16(tmp_path_factory):
    # BF16 has FP32's exponent range: the logits that overflow FP16 fit, so no loss is NaN and
    # the recorder snapshots no failure. The gradients do explode (1/tau scales q and k), so a
    # gradient-norm spike snapshot is the one kind it may write.
    run_dir = sample_run(tmp_path_factory, "fp16_attention_overflow", amp="bf16")
    findings = _findings(run_dir)
    assert "nonfinite_loss" not in findings
    assert [p.name for p in snapshots_of(run_dir) if not p.name.endswith("-grad_spike.pt")] == []


def test_log_zero_is_a_numerical_bug_at_aten_log_that_fails_in_fp32_too(tmp_path_factory):
    run_dir = sample_run(tmp_path_factory, "log_zero")
    findings = _findings(run_dir)
    # The corrupted record arrives at BAD_STEP; the scale had no reason to move before it.
    assert findings["nonfinite_loss"]["step"] == log_zero.BAD_STEP
    assert findings["nonfinite_loss"]["evidence"]["scale_fell_before"] is False

    result = _replay_first(run_dir)
    # exp(-hundreds) is exactly 0 in every precision, so FP32 fails too, at the log; the log is
    # in the loss function, outside every module of the model.
    assert result["verdict"] == "numerical_bug"
    assert result["culprit"]["op"].startswith("aten.log")
    assert result["culprit"]["module"] == "<loss_fn>"
    assert result["culprit"]["phase"] == "forward"
    assert not result["runs"]["float32"]["finite"]


def test_masked_padding_is_a_numerical_bug_in_the_softmax_of_the_first_attention(tmp_path_factory):
    run_dir = sample_run(tmp_path_factory, "masked_padding")
    findings = _findings(run_dir)
    assert findings["nonfinite_loss"]["step"] == masked_padding.BAD_STEP  # the empty sequence's step

    result = _replay_first(run_dir)
    # masked_fill(-inf) is intended; softmax over a row of only -inf is 0/0 in any precision,
    # and blocks.0 is the first attention the empty sequence reaches.
    assert result["verdict"] == "numerical_bug"
    assert result["culprit"]["op"].startswith("aten._softmax")
    assert result["culprit"]["module"] == "blocks.0.attn"
    assert result["culprit"]["phase"] == "forward"
    assert not result["runs"]["float32"]["finite"]


def test_custom_op_outside_autocast_is_an_unregistered_op_in_an_activation(tmp_path_factory):
    run_dir = sample_run(tmp_path_factory, "custom_op_outside_autocast")
    findings = _findings(run_dir)
    # The conv outputs grow as the CNN learns; the largest input of features.4's softplus is
    # 10.33 at step 27 and 11.20 at step 28 (seed 0, the same on avx512, avx2 and default
    # kernels), the first past log(65504) ~= 11.09. Nothing skipped steps before that.
    assert findings["nonfinite_loss"]["step"] == custom_op_outside_autocast.FIRST_NAN_STEP
    assert findings["nonfinite_loss"]["evidence"]["scale_fell_before"] is False

    result = _replay_first(run_dir)
    # The custom op got FP16 inputs (autocast has no rule for it) and its exp overflowed; it is
    # the op of both FusedSoftplus modules. FP32 computes it finitely.
    assert result["verdict"] == "unregistered_op"
    assert result["culprit"]["op"].startswith("samples.softplus")
    assert result["culprit"]["module"] == "features.4"  # the second activation, whose inputs are larger
    assert result["culprit"]["phase"] == "forward"
    assert result["culprit"]["precision"] == "float16"
    assert result["runs"]["float32"]["finite"]


def test_registering_the_custom_op_with_autocast_fixes_the_run(tmp_path):
    # The fix the replay advises, applied from the command line in a fresh process (an autocast
    # registration is global and permanent): the same run now stays finite.
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "samples.custom_op_outside_autocast", "--out", str(out),
                           "--register-autocast"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "[custom_op_outside_autocast] step   0/40" in proc.stdout  # progress while training
    assert f"run directory: {out}" in proc.stdout
    findings = _findings(out)
    assert _serious(findings) == set()
    assert snapshots_of(out) == []


def test_stalled_layers_names_the_early_layers_and_a_vanishing_gradient_through_depth(tmp_path_factory):
    run_dir = sample_run(tmp_path_factory, "stalled_layers")
    findings = _findings(run_dir)
    # Gradients shrink ~10x per sigmoid layer from the head back: the first layers stall, the
    # head does not, and the trend against depth is the vanishing-gradient signature.
    stalled = findings["stalled_layers"]["evidence"]["layers"]
    assert "layers.0.weight" in stalled
    assert "head.weight" not in stalled
    assert "vanishing_gradients" in findings
    assert "nonfinite_loss" not in findings
    assert snapshots_of(run_dir) == []  # the loss never fails, so nothing is snapshotted


def test_loss_outside_autocast_reports_a_low_precision_loss_and_nothing_worse(tmp_path_factory):
    run_dir = sample_run(tmp_path_factory, "loss_outside_autocast")
    findings = _findings(run_dir)
    # cross_entropy outside autocast returns FP16 on every step; the model is the healthy one.
    assert findings["low_precision_loss"]["severity"] == "warning"
    assert _serious(findings) == {"low_precision_loss"}
    assert snapshots_of(run_dir) == []


def test_bf16_nan_is_a_numerical_bug_at_the_division_of_the_eps_free_normalisation(tmp_path_factory):
    run_dir = sample_run(tmp_path_factory, "bf16_nan")
    findings = _findings(run_dir)
    nonfinite = findings["nonfinite_loss"]
    assert nonfinite["step"] == bf16_nan.BAD_STEP  # the batch where the flag is constant
    assert "BF16" in nonfinite["message"]  # in BF16 a NaN is never a range problem

    result = _replay_first(run_dir)
    # (x - mean) / std is 0 / 0 on the constant feature; it runs in FP32 under autocast anyway.
    assert result["verdict"] == "numerical_bug"
    assert result["culprit"]["op"].startswith("aten.div")
    assert result["culprit"]["module"] == "norm"
    assert result["culprit"]["phase"] == "forward"
    assert not result["runs"]["float32"]["finite"]


def test_healthy_has_no_errors_or_warnings_and_its_last_step_replays_healthy(tmp_path_factory):
    run_dir = sample_run(tmp_path_factory, "healthy")
    findings = _findings(run_dir)
    assert _serious(findings) == set()  # the baseline: any error or warning here is a false alarm

    result = _replay_first(run_dir)  # the manual snapshot of the last step
    assert result["verdict"] == "healthy"
    assert result["culprit"] is None

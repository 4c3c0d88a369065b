"""``weights_exploded`` on real recorded runs: an update that multiplied the weights, and healthy runs that did not."""
from __future__ import annotations

import pytest
import torch

from analyzer.autopsy import run_autopsy
from analyzer.report import build_report
from recorders import Recorder
from tests.recorders.models import batches, build_mlp, mse_loss, sgd, train

REF = "tests.recorders.models"


def _run(run_dir, *, opt_fn, steps=8, amp_dtype=None, model_kw=None):
    model = build_mlp(**(model_kw or {}))
    opt = opt_fn(model)
    with Recorder(run_dir, model, factory=f"{REF}:build_mlp", factory_kwargs=model_kw or {},
                  loss_fn=f"{REF}:mse_loss", optimizer=opt, amp_dtype=amp_dtype) as rec:
        losses = train(model, batches(steps), rec=rec, opt=opt, amp_dtype=amp_dtype)
    return run_dir, losses


@pytest.fixture(scope="module")
def exploded(tmp_path_factory):
    # SGD at lr=1e5: the first update multiplies every weight by ~1e4-1e5, the loss is 2e18 at step 1
    # and NaN from step 2 on
    return _run(tmp_path_factory.mktemp("lr1e5") / "run", opt_fn=lambda m: sgd(m, lr=1e5))


def test_an_update_at_lr_1e5_is_weights_exploded_at_its_step_with_the_lr(exploded):
    run, losses = exploded
    assert losses[1] > 1e15
    rep = build_report(run)
    [f] = [f for f in rep.findings if f.check == "weights_exploded"]
    assert (f.severity, f.step) == ("error", 0)
    assert f.evidence["lr"] == pytest.approx(1e5) and f.evidence["factor"] >= 100
    assert f.evidence["norm_after"] >= 100 * f.evidence["norm_before"]
    assert f.message.startswith("the update of step 0 multiplied the weights' norm of ")
    assert "at lr 1e+05" in f.message and "lower it" in f.message
    assert min(rep.errors, key=lambda e: e.step).check == "weights_exploded"


@pytest.mark.slow
def test_the_autopsy_leads_with_the_exploded_update_then_the_replayed_failure(exploded):
    run, _ = exploded
    a = run_autopsy(run)
    answer = a.answer()
    assert answer[0].startswith("root cause: weights_exploded: the update of step 0 multiplied")
    assert answer[1].startswith(f"then, at step {a.primary.step}: {a.verdict}: ")


@pytest.mark.parametrize("opt_fn, amp_dtype", [
    (lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), None),
    (lambda m: torch.optim.Adam(m.parameters(), lr=1e-1), torch.bfloat16),
    (lambda m: sgd(m, lr=0.05), None),
], ids=["adam-1e-3-fp32", "adam-1e-1-bf16", "sgd-0.05-fp32"])
def test_ordinary_training_is_not_weights_exploded(tmp_path, opt_fn, amp_dtype):
    run, _ = _run(tmp_path / "run", opt_fn=opt_fn, steps=12, amp_dtype=amp_dtype)
    assert not [f for f in build_report(run).findings if f.check == "weights_exploded"]


def test_a_tiny_initialised_bias_growing_to_an_ordinary_size_is_not_weights_exploded(tmp_path):
    model = build_mlp()
    with torch.no_grad():
        model[0].bias.fill_(1e-9)  # Adam's first update moves it by ~lr per element: x1e6, to ~3e-3
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Recorder(tmp_path / "run", model, optimizer=opt) as rec:
        train(model, batches(6), rec=rec, opt=opt)
    assert not [f for f in build_report(tmp_path / "run").findings if f.check == "weights_exploded"]


def test_an_hf_trainer_run_at_lr_1e5_is_weights_exploded_at_hfs_step_1_with_its_lr(hf_blowup_run):
    # tests/hf_runs.py: a tiny Llama, BF16, learning_rate=1e5; HF logs grad_norm nan from step 4
    rep = build_report(hf_blowup_run["run_dir"])
    [f] = [f for f in rep.findings if f.check == "weights_exploded"]
    assert (f.step, f.evidence["lr"]) == (1, pytest.approx(1e5))
    assert f.evidence["factor"] > 1e4
    assert min(rep.errors, key=lambda e: e.step) is f


@pytest.mark.slow
def test_the_hf_autopsy_leads_with_the_exploded_update_before_the_nan_gradients(hf_blowup_run):
    a = run_autopsy(hf_blowup_run["run_dir"], device="cpu")
    answer = a.answer()
    assert answer[0].startswith("root cause: weights_exploded: the update of step 1 multiplied")
    assert "at lr 1e+05" in answer[0]
    # the replayed failure follows: the first snapshot after the update (the NaN-gradient step HF logs,
    # 4 on AVX2/AVX-512; its rounding moves it with the CPU's kernels, the exploded update does not)
    assert answer[1].startswith(f"then, at step {a.primary.step}: ") and a.primary.step > 1

"""Causes a user can act on, in real HF Trainer runs (``tests/hf_runs.py``, a tiny Llama, BF16):
a batch of one whose every label is -100 (HF's loss is 0/0 inside transformers), and a
learning_rate of 1e5 with two layers (the residual stream overflows ``pow`` in an RMSNorm, and
``rsqrt(inf) = 0`` hides it in forward until backward goes NaN)."""
from __future__ import annotations

import pytest

from analyzer.autopsy.autopsy import run_autopsy
from analyzer.replay.detection._actionable import installed_line
from tests.extras import require

require("transformers", "hf")
require("accelerate", "hf")

from tests import hf_runs  # noqa: E402

NO_TARGET_AT = 2  # the example (= the step, batch size 1) whose labels are all -100


@pytest.fixture(scope="module")
def no_target(tmp_path_factory):
    run = hf_runs.train_hf(tmp_path_factory.mktemp("hf_no_target"), lr=1e-3, steps=4, batch=1,
                           dataset=hf_runs.NoTargetData(4, NO_TARGET_AT))
    return run_autopsy(run["run_dir"], device="cpu")


@pytest.fixture(scope="module")
def blowup2(tmp_path_factory):
    run = hf_runs.train_hf(tmp_path_factory.mktemp("hf_blowup2"), layers=2)
    return run_autopsy(run["run_dir"], device="cpu")


def test_no_fix_of_the_all_minus_100_batch_points_into_site_packages(no_target):
    a = no_target
    c = a.primary.culprit
    assert (c["op"], installed_line(c["source"])) == ("aten.div", True)  # transformers' loss_utils: 0/0
    assert a.fixes
    for _, f in a.fixes:
        assert "site-packages" not in f.title and "site-packages" not in f.detail, f
    guard = [f for _, f in a.fixes if f.name.startswith("guard_")]
    assert [(f.name, f.status) for f in guard] == [("guard_clamp", "not_tried")]
    assert "installed library transformers" in guard[0].title
    for _, adv in a.advice:
        assert adv.fix not in ("guard_clamp", "guard_eps") and "site-packages" not in adv.text


def test_the_answer_names_the_batchs_labels_and_the_empty_target_count(no_target):
    a = no_target
    assert a.primary.step == NO_TARGET_AT + 1  # HF numbers its steps from 1
    head = a.answer()[0]
    assert "every label is -100 in the batch entry `labels`" in head
    assert "no target tokens (num_items_in_batch = 0)" in head
    assert any("Skip such batches" in line for line in a.answer())


def test_the_lr_1e5_answer_leads_with_weights_exploded_then_the_forward_pow_in_input_layernorm(blowup2):
    lines = blowup2.answer()
    assert lines[0].startswith("root cause: weights_exploded: the update of step 1") and "lr 1e+05" in lines[0]
    then = lines[1]
    assert then.startswith("then, at step ")
    # the first event in time heads the replay's sentence: the forward pow, before the backward symptom
    pow_at = then.index("aten.pow in `model.layers.1.input_layernorm` (forward")
    assert pow_at < then.index("in backward")
    assert lines[2].startswith("first non-finite op: aten.pow in model.layers.1.input_layernorm")
    assert lines[3].startswith("where: ") and "backward" in lines[3]
    hidden = blowup2.primary.hidden_nonfinite
    assert (hidden["op"], hidden["phase"], hidden["output_kind"]) == ("aten.pow", "forward", "inf")

"""A deliberate -inf mask is an input to the story, never its culprit, whatever op wrote it.

The runs are real: a tiny pooling model trained with the real ``Recorder`` until a batch with a
fully masked row arrives (pytorch/pytorch#31829), then replayed from the snapshot it wrote.
"""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzer.render import render_replay_text
from analyzer.replay import VERDICTS, replay_snapshot
from recorders.snapshot import build_snapshot, write_snapshot

from . import replay_models as rm
from .test_replay import _line_of

B, T, D = 3, 5, 4
FAIL_AT = 2  # the step whose batch holds a fully masked row


def _batches(n: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(n):
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[:, 3:] = False                  # padding: the last two positions of every row
        if step == FAIL_AT:
            mask[1] = False                  # sample 1 has no valid position at all
        out.append({"x": torch.randn(B, T, D, generator=g), "mask": mask, "y": torch.randn(B, 1, generator=g)})
    return out


@pytest.fixture(scope="module")
def pooled_run(tmp_path_factory):
    step, path = rm.train_until_failure(tmp_path_factory.mktemp("lse"), factory="build_logsumexp_pool",
                                        loss_fn="pool_mse", batches=_batches(), amp_dtype=torch.bfloat16)
    return step, path, replay_snapshot(path)


def test_a_fully_masked_logsumexp_row_keeps_the_loss_finite_and_is_snapshotted_as_nonfinite_grads(pooled_run):
    step, path, r = pooled_run
    assert step == FAIL_AT and r.reason == "nonfinite_grads"
    assert math.isfinite(r.recorded_loss)
    assert r.runs["float32"]["forward_finite"] and not r.runs["float32"]["backward_finite"]


def test_the_logsumexp_backward_not_the_masked_fill_is_the_culprit(pooled_run):
    r = pooled_run[2]
    json.loads(json.dumps(r.to_dict(), allow_nan=False))
    assert r.verdict == "numerical_bug" and r.verdict in VERDICTS
    c = r.culprit
    assert (c["phase"], c["node"], c["precision"]) == ("backward", "LogsumexpBackward0", "float32")
    # logsumexp's backward is grad * exp(x - result): the subtraction -inf - -inf is where NaN is born
    assert (c["op"], c["output_kind"]) == ("aten.sub", "nan")
    assert c["source"].endswith(_line_of("pooled = torch.logsumexp("))
    assert r.literal_nonfinite["op"] == "aten.masked_fill" and r.literal_nonfinite["phase"] == "forward"
    assert r.nonfinite_inputs == [] and r.hidden_nonfinite is None


def test_the_logsumexp_advice_names_the_fully_masked_row_and_not_a_log_clamp(pooled_run):
    text = " ".join(pooled_run[2].advice)
    assert "logsumexp" in text and "every entry is masked" in text and "finfo" in text
    assert "Clamp the argument of log" not in text


# How the -inf was written -> the op that wrote it, as the dispatch mode sees it.
MASK_FORMS = {
    "masked_fill": "aten.masked_fill",     # zeros.masked_fill(~mask, -inf)
    "where": "aten.scalar_tensor",         # torch.where(mask, 0.0, -inf): the wrapped -inf
    "full": "aten.full",                   # torch.where(mask, zeros, torch.full(shape, -inf))
    "index_put": "aten.lift_fresh",        # bias[~mask] = -inf: the lifted -inf, then index_put_
}


@pytest.mark.parametrize("form", sorted(MASK_FORMS))
def test_every_way_of_writing_the_mask_leaves_the_culprit_in_the_logsumexp_backward(tmp_path, form):
    batch = _batches()[FAIL_AT]
    path = rm.record_step(tmp_path, factory="build_logsumexp_pool", loss_fn="pool_mse", batch=batch,
                          factory_kwargs={"mask_form": form}, amp_dtype=torch.bfloat16)
    r = replay_snapshot(path)
    assert r.verdict == "numerical_bug"
    assert (r.culprit["phase"], r.culprit["node"]) == ("backward", "LogsumexpBackward0")
    assert r.literal_nonfinite["op"] == MASK_FORMS[form]


# -- a mask that arrives from outside the step: a -inf buffer, or an additive mask in the batch --
def test_a_causal_minus_inf_buffer_is_a_mask_not_a_nonfinite_input_and_the_overflow_is_found(tmp_path):
    g = torch.Generator().manual_seed(0)
    # gain 8 and |x| ~ 10 sqrt(8): the kept diagonal logits 64 |x|^2 ~ 1e5 exceed FP16's 65504
    batch = {"x": torch.randn(2, 8, 8, generator=g) * 10, "y": torch.randn(2, 8, 1, generator=g)}
    path = rm.record_step(tmp_path, factory="build_attention", loss_fn="attention_mse", batch=batch,
                          factory_kwargs={"d": 8, "gain": 8.0, "causal": 8}, amp_dtype=torch.float16)
    r = replay_snapshot(path)
    assert r.verdict == "overflow"
    assert (r.culprit["op"], r.culprit["module"], r.culprit["phase"]) == ("aten.bmm", "attn", "forward")
    assert r.mask_inputs == ["buffer:causal"] and r.nonfinite_inputs == []
    assert "-inf masks among the inputs (written on purpose): buffer:causal" in render_replay_text(r)


def test_an_additive_batch_mask_with_a_fully_masked_row_is_a_numerical_bug_at_softmax(tmp_path):
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(2, 8, 8)
    mask[0, 3, :] = float("-inf")  # query 3 of sample 0 may attend to nothing
    batch = {"x": torch.randn(2, 8, 8, generator=g), "y": torch.randn(2, 8, 1, generator=g), "mask": mask}
    path = rm.record_step(tmp_path, factory="build_attention", loss_fn="attention_mse", batch=batch,
                          factory_kwargs={"d": 8, "scaled": True}, amp_dtype=torch.bfloat16)
    r = replay_snapshot(path)
    json.loads(json.dumps(r.to_dict(), allow_nan=False))
    assert r.verdict == "numerical_bug"
    assert (r.culprit["op"], r.culprit["module"], r.culprit["output_kind"]) == ("aten._softmax", "attn", "nan")
    assert r.mask_inputs == ["batch:mask"] and r.nonfinite_inputs == []
    assert r.to_dict()["mask_inputs"] == ["batch:mask"]
    assert "written on purpose by the mask batch:mask" in r.summary
    assert any("finite mask value" in a for a in r.advice)


def test_a_minus_inf_feature_among_nonzero_values_is_still_a_nonfinite_input(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, generator=g)
    x[1, 2] = float("-inf")  # log(0) in preprocessing: a data bug, not a mask (other entries are not 0)
    path = rm.record_step(tmp_path, factory="build_mlp", loss_fn="mse",
                          batch={"x": x, "y": torch.randn(4, 1, generator=g)}, amp_dtype=torch.float16)
    r = replay_snapshot(path)
    assert r.verdict == "nonfinite_input"
    assert r.nonfinite_inputs == ["batch:x"] and r.mask_inputs == []


@settings(max_examples=10, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=8, max_size=8), min_size=8, max_size=8),
       st.lists(st.integers(0, 7), max_size=2), st.sampled_from(["batch", "buffer"]))
def test_any_additive_mask_from_outside_the_step_is_a_mask_input_and_blamed_only_through_softmax(
        allowed, dropped, where):
    """Generated 0/-inf masks, in the batch or as a model buffer: never a nonfinite_input.

    Each query keeps its own key unless its row is in `dropped`, which masks it fully.
    """
    keep = torch.tensor(allowed) | torch.eye(8, dtype=torch.bool)
    keep[dropped] = False
    mask = torch.zeros(8, 8).masked_fill(~keep, float("-inf"))
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(2, 8, 8, generator=g), "y": torch.randn(2, 8, 1, generator=g)}
    kwargs = {"d": 8, "scaled": True, "causal": 8 if where == "buffer" else 0}
    model = rm.build_attention(**kwargs)
    if where == "buffer":
        model.causal.copy_(mask)
    else:
        batch["mask"] = mask
    with tempfile.TemporaryDirectory() as d:
        snap = build_snapshot(step=1, reason="manual", model=model, batch=batch,
                              rng={"cpu": torch.get_rng_state(), "cuda": None},
                              factory=f"{rm.REF}:build_attention", factory_kwargs=kwargs,
                              loss_fn=f"{rm.REF}:attention_mse", amp_dtype=torch.bfloat16, device_type="cpu")
        r = replay_snapshot(write_snapshot(Path(d) / "s.pt", snap))
    assert r.nonfinite_inputs == []
    if keep.all():  # no -inf at all: nothing to report
        assert r.mask_inputs == [] and r.verdict == "healthy"
        return
    assert r.mask_inputs == (["buffer:causal"] if where == "buffer" else ["batch:mask"])
    if not dropped:  # every query keeps a key: softmax is finite
        assert r.verdict == "healthy"
    else:            # a fully masked query row: softmax turns the mask into NaN
        assert r.verdict == "numerical_bug" and r.culprit["op"] == "aten._softmax"

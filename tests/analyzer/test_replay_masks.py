"""A deliberate -inf mask is an input to the story, never its culprit, whatever op wrote it.

The runs are real: a tiny pooling model trained with the real ``Recorder`` until a batch with a
fully masked row arrives (pytorch/pytorch#31829), then replayed from the snapshot it wrote.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from analyzer.replay import VERDICTS, replay_snapshot

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
    assert "logsumexp" in text and "finfo" in text
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

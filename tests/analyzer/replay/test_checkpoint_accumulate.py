"""``analyzer replay CHECKPOINT --batch FILE`` where FILE holds the step's micro-batches: replayed as accumulation.

A real loop without a recorder: four micro-batches per optimizer step, ``loss / 4`` each, a
checkpoint of the weights the step starts from and ``torch.save(mbs)`` of its micro-batches. The
replay runs each micro-batch's forward and backward and sums the gradients as the loop did, and
names the micro-batch a NaN is in; ``--accumulate`` changes the normalisation (and ``join`` brings
back the one-batch replay).
"""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main
from tests.analyzer.replay import replay_models as rm

MICRO, BAD = 4, 2
_REFS = ["--factory", f"{rm.REF}:build_mlp", "--loss-fn", f"{rm.REF}:mse"]


def _micro_batches(nan: bool) -> list[dict]:
    g = torch.Generator().manual_seed(11)
    rows = [3, 3, 3, 1]  # an epoch's short last micro-batch: joining them weighs its row 3x less than the loop did
    mbs = [{"x": torch.randn(n, 4, generator=g), "y": torch.randn(n, 1, generator=g)} for n in rows]
    if nan:
        mbs[BAD]["x"][0, 3] = float("nan")
    return mbs


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    """One FP32 optimizer step of a loop that accumulates (``loss / MICRO``): its checkpoint, micro-batches
    and the gradients it summed."""
    d = tmp_path_factory.mktemp("ckpt_accum")
    model = rm.build_mlp()
    torch.save({"model": model.state_dict(), "step": 7}, d / "ckpt.pt")
    mbs = _micro_batches(nan=False)
    for mb in mbs:
        (rm.mse(model, mb) / MICRO).backward()
    torch.save(mbs, d / "mbs.pt")
    torch.save(_micro_batches(nan=True), d / "nan_mbs.pt")
    return d, [p.grad.clone() for p in model.parameters()]


def _replayed_grads(d, batch: str, accumulate: str) -> list[torch.Tensor]:
    from analyzer.load.adhoc import load_checkpoint_snapshot
    from analyzer.replay import Replay
    from analyzer.replay.runs._runs import run_once

    snap = load_checkpoint_snapshot(d / "ckpt.pt", d / batch, factory=f"{rm.REF}:build_mlp",
                                    loss_fn=f"{rm.REF}:mse", amp="bf16", accumulate=accumulate)
    ctx = Replay(snap, device="cpu").context()
    run_once(ctx, "float32", 1.0)
    return [p.grad for p in ctx._model.parameters()]  # run_once leaves the step's gradients there


def test_the_default_replays_each_micro_batch_with_loss_over_n_to_the_gradients_the_loop_summed(loop):
    d, trained = loop
    for got, want in zip(_replayed_grads(d, "mbs.pt", "auto"), trained):  # FP32, the same ops in the same order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    joined = _replayed_grads(d, "mbs.pt", "join")  # the one-batch replay: another step, so the check can fail
    assert not torch.allclose(joined[0], trained[0], rtol=1e-3)


def test_accumulate_sum_replays_undivided_losses_n_times_the_loop_gradients(loop):
    d, trained = loop
    for got, want in zip(_replayed_grads(d, "mbs.pt", "sum"), trained):
        torch.testing.assert_close(got, want * MICRO, rtol=1e-5, atol=1e-6)


def test_a_nan_in_micro_batch_2_is_named_with_its_micro_batch_and_the_assumed_normalisation(loop):
    d, _ = loop
    res = CliRunner().invoke(main, ["replay", str(d / "ckpt.pt"), "--batch", str(d / "nan_mbs.pt"), *_REFS, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["verdict"] == "nonfinite_input" and out["nonfinite_inputs"] == [f"batch:{BAD}.x"]
    assert out["culprit"]["micro_batch"] == BAD
    assert out["micro_batches"] == {"count": MICRO, "combine": "mean", "divisor": float(MICRO),
                                    "source": "batch_file", "num_items_in_batch": None}
    note = next(n for n in out["checkpoint"]["notes"] if "micro-batches" in n)
    assert "replayed as gradient accumulation" in note and f"each loss divided by {MICRO}" in note
    text = CliRunner().invoke(main, ["replay", str(d / "ckpt.pt"), "--batch", str(d / "nan_mbs.pt"), *_REFS]).output
    assert f"micro-batch {BAD} of {MICRO} (0-based)" in text
    assert f"NB: the batch file holds {MICRO} micro-batches: replayed as gradient accumulation" in text


def test_accumulate_join_replays_one_batch_their_concatenation(loop):
    d, _ = loop
    res = CliRunner().invoke(main, ["replay", str(d / "ckpt.pt"), "--batch", str(d / "nan_mbs.pt"), *_REFS,
                                    "--accumulate", "join", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["micro_batches"] is None and out["nonfinite_inputs"] == ["batch:x"]
    assert out["culprit"].get("micro_batch") is None


def test_accumulate_without_batch_is_a_usage_error(loop):
    d, _ = loop
    res = CliRunner().invoke(main, ["replay", str(d / "ckpt.pt"), "--accumulate", "sum"])
    assert res.exit_code == 2 and "--accumulate go with --batch" in res.output


def test_autopsy_of_the_checkpoint_heads_its_answer_with_micro_batch_2(loop):
    d, _ = loop
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = CliRunner().invoke(main, ["autopsy", str(d / "ckpt.pt"), "--batch", str(d / "nan_mbs.pt"), *_REFS])
    assert res.exit_code == 0, res.output
    root = next(line for line in res.output.splitlines() if "root cause:" in line)
    assert "nonfinite_input" in root and f"batch:{BAD}.x" in root and f"micro-batch {BAD} (0-based)" in root

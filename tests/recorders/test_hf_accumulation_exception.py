"""HF Trainer with ``gradient_accumulation_steps=4``: an exception in the third micro-batch of an optimizer step.

The Trainer fetches a step's micro-batches before its first forward and normalises each loss for the
whole step: by the step's ``num_items_in_batch`` inside the model when the model takes it, otherwise
by the step's micro-batch count (``current_gradient_accumulation_steps``, 4 here, or the epoch's
remainder). An ``exception`` snapshot written after three micro-batches must keep that
normalisation, not divide by the three it saw, so that replaying the three re-makes the gradients
the Trainer had summed when it raised. Real FP32 runs of a tiny Llama built from a config; the
Trainer raises right after the third micro-batch's backward and keeps its own gradients.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from recorders import schema
from tests import hf_runs
from tests.extras import require

require("transformers", "hf")

ACCUM, BATCH, STEP, MICRO = 4, 2, 2, 2  # raise in micro-batch 2 (0-based) of HF's step 2


def _train(root: Path, *, normalized: bool, dataset=None, steps: int = 3, grab_step: int | None = None) -> dict:
    """Train until the third micro-batch of step `STEP` raises (or, with `grab_step`, snapshot that step by
    hand before its optimizer step and run to the end). The Trainer's gradients at that point are kept."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from recorders.integrations.hf import AmpAutopsyCallback

    seen = {"calls": 0, "grads": None}

    class RaisingTrainer(Trainer):
        def training_step(self, model, inputs, *args, **kwargs):
            loss = super().training_step(model, inputs, *args, **kwargs)
            seen["calls"] += 1
            if grab_step is None and seen["calls"] == (STEP - 1) * ACCUM + MICRO + 1:
                seen["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                raise RuntimeError(f"stopped after micro-batch {MICRO} of step {STEP}")
            return loss

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step + 1 == grab_step:
                cb.recorder.snapshot()
                seen["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    cb = AmpAutopsyCallback(root / "run")
    model = hf_runs.tiny_llama()
    if not normalized:
        model.accepts_loss_kwargs = False  # the Trainer then divides each loss by the step's micro-batch count
    args = TrainingArguments(
        output_dir=str(root / "out"), use_cpu=True, max_steps=steps if dataset is None else -1, num_train_epochs=1,
        learning_rate=1e-3, per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM, report_to=[],
        logging_strategy="no", save_strategy="no", disable_tqdm=True, seed=0, max_grad_norm=0.0)
    data = dataset if dataset is not None else hf_runs.TokenData(steps * ACCUM * BATCH)
    with warnings.catch_warnings(), torch.random.fork_rng():
        warnings.simplefilter("ignore")
        trainer = RaisingTrainer(model=model, args=args, train_dataset=data, callbacks=[cb, Grab()])
        if grab_step is None:
            with pytest.raises(RuntimeError, match="stopped after micro-batch"), cb.guard():
                trainer.train()
        else:
            trainer.train()
    return {"run_dir": root / "run", "grads": seen["grads"]}


@pytest.fixture(scope="module", params=["num_items_in_batch", "mean"])
def raised(request, tmp_path_factory):
    run = _train(tmp_path_factory.mktemp(f"hf_accum_exc_{request.param}"), normalized=request.param != "mean")
    [path] = (run["run_dir"] / schema.SNAPSHOT_DIR).glob(f"step{STEP:08d}-*-exception.pt")
    return request.param, path, run["grads"]


def _replayed_grads(path: Path) -> tuple[dict, object]:
    from analyzer.replay import Replay
    from analyzer.replay.runs._runs import run_once

    ctx = Replay(path, device="cpu").context()
    trace = run_once(ctx, "float32", 1.0)
    return {n: p.grad for n, p in ctx._model.named_parameters() if p.grad is not None}, trace


def test_the_exception_snapshot_keeps_the_three_micro_batches_with_the_whole_steps_normalisation(raised):
    combine, path, _ = raised
    snap = torch.load(path, weights_only=True)
    assert len(snap["batch"]) == MICRO + 1
    items = ACCUM * BATCH * (hf_runs.SEQ - 1)  # every label of the four micro-batches, shifted by one token
    want = {"count": MICRO + 1, "combine": combine, "divisor": 1.0 if combine != "mean" else float(ACCUM),
            "source": "hf_trainer", "num_items_in_batch": items if combine != "mean" else None}
    assert snap["micro_batches"] == want
    if combine != "mean":  # counted over the whole step before the first forward, in every micro-batch's inputs
        assert all(int(mb["num_items_in_batch"]) == items for mb in snap["batch"])


def test_the_replay_text_says_the_divisor_is_the_whole_steps(raised):
    from analyzer.render import render_replay_text
    from analyzer.replay import replay_snapshot

    combine, path, _ = raised
    text = render_replay_text(replay_snapshot(path, device="cpu"))
    if combine == "mean":
        assert f"divided by the number of micro-batches ({ACCUM}, the whole step's; {MICRO + 1} ran)" in text
    else:
        assert f"accumulated {MICRO + 1} micro-batches as training did" in text and "num_items_in_batch=" in text


def test_replaying_the_three_micro_batches_remakes_the_gradients_the_trainer_had_summed(raised):
    combine, path, trained = raised
    got, trace = _replayed_grads(path)
    assert trained and set(got) == set(trained)
    for name, want in trained.items():  # FP32 on both sides; dividing by 3 instead of 4 would be 4/3 of them
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-6)
    snap = torch.load(path, weights_only=True)
    assert trace.loss == pytest.approx(float(snap["loss"]), rel=1e-5)  # the trace row's loss: the same shares


def test_the_epochs_short_last_step_divides_by_its_own_micro_batch_count(tmp_path):
    """10 micro-batches per epoch at 4 per step: steps of 4, 4 and 2; the last divides each loss by 2."""
    ex = list(hf_runs.TokenData(10 * BATCH))
    run = _train(tmp_path, normalized=False, dataset=ex, grab_step=3)
    [path] = (run["run_dir"] / schema.SNAPSHOT_DIR).glob("step00000003-*-manual.pt")
    snap = torch.load(path, weights_only=True)
    assert snap["micro_batches"]["count"] == 2 and snap["micro_batches"]["divisor"] == 2.0
    got, _ = _replayed_grads(path)
    for name, want in run["grads"].items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("accum, length, step, n", [
    (4, None, 5, 4),           # no dataloader length: every step is accum long
    (4, 12, 2, 4), (4, 10, 1, 4), (4, 10, 2, 2), (4, 10, 5, 2),  # 10 per epoch: 4, 4, 2 each epoch
    (4, 3, 0, 3), (4, 3, 7, 3),  # shorter than one step: every step is the remainder
    (1, 7, 3, 1),
])
def test_the_step_micro_batch_count_follows_the_trainers_rule(accum, length, step, n):
    from recorders.integrations._hf_accum import step_micro_batches

    assert step_micro_batches(accum, length, step) == n

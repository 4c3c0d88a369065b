"""HF Trainer with ``gradient_accumulation_steps=4``: the callback keeps all four micro-batches of a step.

A tiny Llama (built from a config, no download) fed float ``inputs_embeds``: a NaN feature in the third
micro-batch of optimizer step 2 makes that step's loss NaN. The snapshot holds the four micro-batches and
says the model divided each loss by the step's ``num_items_in_batch``; the replay re-runs all four and
names the NaN input in micro-batch 2 (0-based); the autopsy heads its answer with it. A healthy step,
trained in FP32 without clipping, replays to the gradients the Trainer accumulated.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from recorders import schema
from tests import hf_runs
from tests.extras import require

require("transformers", "hf")

ACCUM, BATCH, STEPS, NAN_STEP, NAN_MICRO = 4, 2, 3, 2, 2


class EmbedData(torch.utils.data.IterableDataset):
    """Float features and token labels; a NaN in one sample of step `NAN_STEP`'s micro-batch `NAN_MICRO`."""

    def __init__(self, nan: bool):
        self.nan = nan

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        bad = ((NAN_STEP - 1) * ACCUM + NAN_MICRO) * BATCH  # HF's step 2 is the second optimizer step
        for i in range(STEPS * ACCUM * BATCH):
            x = torch.randn(hf_runs.SEQ, hf_runs.HIDDEN, generator=g)
            if self.nan and i == bad:
                x[3, 5] = float("nan")
            yield {"inputs_embeds": x, "labels": torch.randint(2, hf_runs.VOCAB, (hf_runs.SEQ,), generator=g)}


def _train(root: Path, *, nan: bool, bf16: bool, extra=()) -> dict:
    from transformers import Trainer, TrainingArguments

    from recorders.integrations.hf import AmpAutopsyCallback

    cb = next((c for c in extra if isinstance(c, AmpAutopsyCallback)), None) or AmpAutopsyCallback(root / "run")
    extra = [c for c in extra if c is not cb]
    args = TrainingArguments(
        output_dir=str(root / "out"), use_cpu=True, bf16=bf16, max_steps=STEPS, learning_rate=1e-3,
        per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM, report_to=[], logging_steps=1,
        save_strategy="no", disable_tqdm=True, seed=0, max_grad_norm=1.0 if nan else 0.0)
    with warnings.catch_warnings(record=True) as caught, torch.random.fork_rng():
        warnings.simplefilter("always")
        trainer = Trainer(model=hf_runs.tiny_llama(), args=args, train_dataset=EmbedData(nan),
                          callbacks=[cb, *extra])
        trainer.train()
    return {"run_dir": root / "run", "callback": cb, "warnings": list(caught)}


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("hf_accum_nan"), nan=True, bf16=True)


def _snapshot(run: dict) -> Path:
    [path] = (run["run_dir"] / schema.SNAPSHOT_DIR).glob(f"step{NAN_STEP:08d}-*.pt")
    return path


def test_the_snapshot_holds_the_four_micro_batches_and_the_num_items_normalisation(nan_run):
    snap = torch.load(_snapshot(nan_run), weights_only=True)
    batch, micro = snap["batch"], snap["micro_batches"]
    assert isinstance(batch, list) and len(batch) == ACCUM
    assert [bool(torch.isnan(mb["inputs_embeds"]).any()) for mb in batch] == [i == NAN_MICRO for i in range(ACCUM)]
    # Llama takes num_items_in_batch: the Trainer passes the step's label count (labels shifted by one token)
    items = ACCUM * BATCH * (hf_runs.SEQ - 1)
    assert micro == {"count": ACCUM, "combine": "num_items_in_batch", "divisor": 1.0, "source": "hf_trainer",
                     "num_items_in_batch": items}
    assert all(int(mb["num_items_in_batch"]) == items for mb in batch)
    assert not [w for w in nan_run["warnings"] if "gradient_accumulation_steps" in str(w.message)]


def test_replay_names_the_nan_input_in_micro_batch_2(nan_run):
    from analyzer.replay import replay_snapshot

    r = replay_snapshot(_snapshot(nan_run), device="cpu")
    assert r.verdict == "nonfinite_input"
    assert r.nonfinite_inputs == [f"batch:{NAN_MICRO}.inputs_embeds"]
    assert r.culprit["micro_batch"] == NAN_MICRO
    assert f"micro-batch {NAN_MICRO} (0-based) of the {ACCUM}" in r.summary
    assert r.to_dict()["micro_batches"]["combine"] == "num_items_in_batch"


@pytest.mark.slow
def test_the_autopsy_heads_its_answer_with_the_nan_input_of_micro_batch_2(nan_run):
    from analyzer.autopsy import run_autopsy
    from analyzer.autopsy.answer import answer_lines

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_autopsy(nan_run["run_dir"], device="cpu")
    head = answer_lines(result)[0]
    assert head.startswith("root cause: nonfinite_input: ")
    assert f"batch:{NAN_MICRO}.inputs_embeds" in head and f"micro-batch {NAN_MICRO} (0-based)" in head


def test_a_healthy_accumulated_step_replays_to_the_gradients_the_trainer_summed(tmp_path):
    from transformers import TrainerCallback

    from analyzer.replay import Replay
    from analyzer.replay.runs._runs import run_once
    from recorders.integrations.hf import AmpAutopsyCallback

    class Grab(TrainerCallback):
        """Before optimizer step 2 (no clipping): a manual snapshot and the Trainer's own gradients."""

        def __init__(self, cb):
            self.cb, self.grads = cb, None

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step + 1 == NAN_STEP:
                self.cb.recorder.snapshot()
                self.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    cb = AmpAutopsyCallback(tmp_path / "run")
    grab = Grab(cb)
    run = _train(tmp_path, nan=False, bf16=False, extra=[cb, grab])
    assert grab.grads, "the step was not grabbed"
    [path] = (run["run_dir"] / schema.SNAPSHOT_DIR).glob("*-manual.pt")
    replay = Replay(path, device="cpu")
    r = replay.run()
    assert r.verdict == "healthy" and r.micro_batches["count"] == ACCUM
    ctx = replay.context()
    run_once(ctx, "float32", 1.0)
    got = dict(ctx._model.named_parameters())  # run_once leaves the accumulated gradients there
    for name, want in grab.grads.items():
        torch.testing.assert_close(got[name].grad, want, rtol=1e-4, atol=1e-6)
    meta = json.loads((run["run_dir"] / schema.META_FILE).read_text())
    assert meta["micro_batches"] == ACCUM and meta["micro_batches_kept"] is True

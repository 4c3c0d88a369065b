"""The HF Trainer adapter drives a real ``transformers.Trainer`` (tiny GPT-2, CPU, BF16 autocast)."""
from __future__ import annotations

import math
import warnings

import polars as pl
import pytest
import torch

from recorders import schema
from tests.extras import require

NAN_STEP = 2      # the optimizer step (0-based) whose batch carries a NaN
HF_NAN_STEP = NAN_STEP + 1  # its number as HF counts steps (global_step after it), which the trace uses
BATCH = 2
STEPS = 4
EMBD, SEQ, VOCAB = 16, 8, 32


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=EMBD, n_layer=1, n_head=2,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


class _Embeds(torch.utils.data.IterableDataset):
    """Float inputs (``inputs_embeds``) so a NaN can sit in the batch. Iterable: the Trainer does not
    shuffle it, so sample ``NAN_STEP * BATCH + 1`` lands in step ``NAN_STEP``."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i in range(STEPS * BATCH):
            x = torch.randn(SEQ, EMBD, generator=g)
            if i == NAN_STEP * BATCH + 1:
                x[3, 5] = float("nan")
            yield {"inputs_embeds": x, "labels": torch.randint(0, VOCAB, (SEQ,), generator=g)}


def _train(run_dir, out_dir, *, fp16=False, bf16=False, model=None, **callback_kwargs):
    from transformers import Trainer, TrainingArguments

    from recorders.integrations.hf import AmpAutopsyCallback

    args = TrainingArguments(
        output_dir=str(out_dir), use_cpu=True, bf16=bf16, fp16=fp16, max_steps=STEPS,
        per_device_train_batch_size=BATCH, learning_rate=1e-3, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, seed=0,
    )
    cb = AmpAutopsyCallback(run_dir, **callback_kwargs)
    trainer = Trainer(model=_gpt2() if model is None else model, args=args, train_dataset=_Embeds(),
                      callbacks=[cb])
    trainer.train()
    return cb


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    require("transformers", "hf")
    require("accelerate", "hf")
    root = tmp_path_factory.mktemp("hf")
    torch.set_num_threads(1)
    cb = _train(root / "run", root / "out", bf16=True)
    return root / "run", cb


def _steps(run_dir) -> pl.DataFrame:
    return pl.read_parquet(run_dir / schema.TRACE_DIR / schema.STEPS_GLOB).sort("step")


def test_a_bf16_trainer_run_records_one_row_per_optimizer_step_with_the_nan_step_kept(bf16_run):
    run_dir, _ = bf16_run
    steps = _steps(run_dir)
    assert steps["step"].to_list() == list(range(1, STEPS + 1))
    loss = steps["loss"].to_list()
    assert all(math.isfinite(v) for v in loss[:NAN_STEP])
    assert math.isnan(loss[NAN_STEP])  # the NaN embedding reaches the loss; the trace keeps it
    # GPT-2's loss is a cross_entropy, which CPU autocast runs in FP32.
    assert steps["loss_dtype"][0] == "float32"
    assert steps["lr"][0] == pytest.approx(1e-3)  # the inner optimizer's lr, before the scheduler decays it


def test_the_run_meta_names_bf16_and_the_pretrained_factory_and_loss(bf16_run):
    import json

    run_dir, _ = bf16_run
    meta = json.loads((run_dir / schema.META_FILE).read_text())
    assert meta["amp_dtype"] == "bfloat16"
    assert meta["factory"] == "recorders.integrations.hf:build_pretrained"
    assert meta["loss_fn"] == "recorders.integrations.hf:pretrained_loss"
    assert meta["factory_kwargs"]["model_class"].endswith(":GPT2LMHeadModel")
    assert meta["params"][0]["name"] == "transformer.wte.weight"  # the unwrapped model's names
    # accelerate enters autocast inside model.forward and casts the outputs back to FP32: the recorder
    # sees it in the forward's graph (parameters cast to low precision), its dtype unknown
    assert (meta["autocast"]["enabled"], meta["autocast"]["inside_forward"]) == (True, True)


def test_the_nan_step_is_snapshotted_with_the_batch_the_trainer_fed_the_model(bf16_run):
    from analyzer.load import load_snapshot

    run_dir, cb = bf16_run
    path = run_dir / schema.SNAPSHOT_DIR / schema.snapshot_name(HF_NAN_STEP, 0, "nonfinite_loss")
    assert path in cb.recorder.snapshots
    snap = load_snapshot(path)
    emb = snap["batch"]["inputs_embeds"]
    assert emb.shape == (BATCH, SEQ, EMBD)
    assert torch.isnan(emb[1, 3, 5]) and torch.isnan(emb).sum() == 1
    assert all(torch.isfinite(t).all() for t in snap["model_state"].values())  # weights before the step


def test_the_snapshot_rebuilds_the_model_and_reproduces_the_nan_loss(bf16_run):
    from recorders.integrations.hf import build_pretrained, pretrained_loss

    run_dir, _ = bf16_run
    snap = torch.load(run_dir / schema.SNAPSHOT_DIR / schema.snapshot_name(HF_NAN_STEP, 0, "nonfinite_loss"),
                      weights_only=True)
    model = build_pretrained(**snap["factory_kwargs"])
    model.load_state_dict(snap["model_state"])
    model.train()
    torch.set_rng_state(snap["rng"]["cpu"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pretrained_loss(model, snap["batch"])
    assert torch.isnan(loss)
    batch = dict(snap["batch"], inputs_embeds=torch.nan_to_num(snap["batch"]["inputs_embeds"]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(pretrained_loss(model, batch))  # the NaN input is the only cause


def test_replay_of_the_trainer_snapshot_blames_the_nan_in_the_batch(bf16_run):
    from analyzer.replay import replay_snapshot

    run_dir, _ = bf16_run
    path = run_dir / schema.SNAPSHOT_DIR / schema.snapshot_name(HF_NAN_STEP, 0, "nonfinite_loss")
    result = replay_snapshot(str(path), device="cpu").to_dict()
    assert result["verdict"] == "nonfinite_input"
    assert result["culprit"]["input"] == "batch:inputs_embeds"  # the batch leaf, not a weight


def test_fp16_on_cpu_trains_in_fp32_so_the_callback_records_fp32_and_warns(tmp_path):
    require("transformers", "hf")
    import json

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cb = _train(tmp_path / "run", tmp_path / "out", fp16=True)
    assert any("recording the run as FP32" in str(w.message) for w in caught)
    meta = json.loads((tmp_path / "run" / schema.META_FILE).read_text())
    assert meta["amp_dtype"] is None and meta["scaler"] is None
    assert cb.recorder.closed  # on_train_end closed it


def test_the_callbacks_fp16_on_cpu_warning_is_a_kept_recorder_warning_that_report_repeats(tmp_path):
    require("transformers", "hf")
    import json

    from click.testing import CliRunner

    from analyzer.cli import main
    from recorders.recorder import RecorderWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(tmp_path / "run", tmp_path / "out", fp16=True)
    [w] = [w for w in caught if "recording the run as FP32" in str(w.message)]
    assert issubclass(w.category, RecorderWarning)
    meta = json.loads((tmp_path / "run" / schema.META_FILE).read_text())
    # warned in on_train_begin, before any step began: no step
    assert meta["warnings"] == [{"kind": "fp16_cpu_as_fp32", "step": None, "message": str(w.message)}]
    assert "fp16_cpu_as_fp32" in schema.WARNING_KINDS
    out = CliRunner().invoke(main, ["report", str(tmp_path / "run"), "--json"])
    found = [f for f in json.loads(out.output)["findings"] if f["check"] == "recorder_warning"]
    assert [f["evidence"]["kind"] for f in found] == ["fp16_cpu_as_fp32"]
    assert "recording the run as FP32" in found[0]["message"] and found[0]["severity"] == "warning"


def test_a_model_that_is_not_a_pretrained_model_needs_an_explicit_factory(tmp_path):
    require("transformers", "hf")

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(EMBD, VOCAB)

        def forward(self, inputs_embeds, labels):
            logits = self.lin(inputs_embeds)
            return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}

    with pytest.raises(ValueError, match="not a PreTrainedModel: pass factory="):
        _train(tmp_path / "run", tmp_path / "out", model=Plain())


def test_build_pretrained_refuses_a_class_outside_pretrained_models():
    require("transformers", "hf")
    from recorders.integrations.hf import build_pretrained

    with pytest.raises(ValueError, match="refusing"):
        build_pretrained("os:system", {})
    with pytest.raises(ValueError, match="not a subclass"):
        build_pretrained("recorders.recorder:Recorder", {})


def test_save_batch_on_nan_saves_the_failing_steps_inputs_and_they_replay_on_the_trainers_checkpoint(tmp_path):
    require("accelerate", "hf")
    from click.testing import CliRunner
    from transformers import Trainer, TrainingArguments

    from analyzer.cli import main
    from recorders.integrations.hf import save_batch_on_nan

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=STEPS, per_device_train_batch_size=BATCH,
        learning_rate=1e-3, report_to=[], save_strategy="steps", save_steps=1, logging_strategy="steps",
        logging_steps=1, disable_tqdm=True, seed=0)
    cb = save_batch_on_nan(tmp_path / "nan_batch.pt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _gpt2()
        states = []  # the CPU generator at each training forward's start (this hook runs before the callback's)
        model.register_forward_pre_hook(lambda m, a: states.append(torch.get_rng_state()) if m.training else None)
        Trainer(model=model, args=args, train_dataset=_Embeds(), callbacks=[cb]).train()
    assert cb.saved_step == NAN_STEP
    assert any("analyzer replay CHECKPOINT --batch" in str(w.message) for w in caught)
    saved = torch.load(tmp_path / "nan_batch.pt", weights_only=True)
    assert torch.equal(saved["rng"]["cpu"], states[NAN_STEP])  # one forward per step: the failing step's
    assert set(saved) == {"batch", "rng"}  # the RNG state the failing forward started from, beside its inputs
    assert saved["rng"]["cpu"].dtype == torch.uint8 and saved["rng"]["cpu"].numel() == torch.get_rng_state().numel()
    assert saved["rng"]["cuda"] is None  # a CPU run
    batch = saved["batch"]
    # the model's keyword inputs as the Trainer passed them (recent transformers adds num_items_in_batch)
    assert {"inputs_embeds", "labels"} <= set(batch) <= {"inputs_embeds", "labels", "num_items_in_batch"}
    assert batch["inputs_embeds"].shape == (BATCH, SEQ, EMBD)
    assert torch.isnan(batch["inputs_embeds"][1, 3, 5])  # sample NAN_STEP * BATCH + 1 is row 1 of the step
    assert int(torch.isnan(batch["inputs_embeds"]).sum()) == 1
    # checkpoint-2 holds the weights after steps 0 and 1: the ones step 2 started from
    res = CliRunner().invoke(main, ["replay", str(tmp_path / "out" / f"checkpoint-{NAN_STEP}"),
                                    "--batch", str(tmp_path / "nan_batch.pt"), "--amp", "bf16", "--json"])
    assert res.exit_code == 0, res.output
    import json

    got = json.loads(res.stdout)
    assert got["verdict"] == "nonfinite_input" and got["nonfinite_inputs"] == ["batch:inputs_embeds"]
    assert got["step"] == NAN_STEP  # trainer_state.json's global_step
    assert got["checkpoint"]["rng"] == str(tmp_path / "nan_batch.pt") and got["checkpoint"]["seed"] is None

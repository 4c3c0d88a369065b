"""Framework runs that raise inside a step: Lightning's ``on_exception`` and HF's ``callback.guard()``.

Lightning: FP16 with a GradScaler (an explicit plugin on CPU), a ``training_step`` that raises on a
non-finite loss; the batch at ``CRASH`` overflows FP16 in the first matmul (as ``tests/exception_runs.py``).
HF: a tiny GPT-2 in FP32 on CPU (accelerate makes no GradScaler there) whose ``compute_loss`` raises on a
NaN loss; the batch at ``CRASH`` carries a NaN embedding.
"""
from __future__ import annotations

import json

import polars as pl
import pytest
import torch
import torch.nn.functional as F

from analyzer.autopsy import run_autopsy
from analyzer.report import build_report
from recorders import schema
from tests.extras import require

CRASH = 2
STEPS = 4
BATCH = 4


def _exception_finding(run_dir):
    found = [f for f in build_report(run_dir).findings if f.check == "exception"]
    assert len(found) == 1
    return found[0]


# ------------------------------------------------------------------------------------------ Lightning
L = require("lightning", "lightning")


class OverflowModule(L.LightningModule):
    """build_overflow as a LightningModule: its first matmul passes 65504 in FP16 on inputs of 5s."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 1))
        with torch.no_grad():
            self.net[0].weight.fill_(1000.0)
            self.net[0].bias.zero_()
            self.net[1].weight.fill_(1e-3)
            self.net[1].bias.zero_()

    def loss(self, batch):
        return F.mse_loss(self.net(batch["x"]).float(), batch["y"])

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if not torch.isfinite(loss):  # the user's own NaN check
            raise FloatingPointError(f"non-finite loss {loss.item()} at step {self.global_step}")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def module_loss(model, batch):
    """The replay's loss: training_step's loss without its raising check."""
    return model.loss(batch)


def _pl_loader():
    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(16, generator=g) * 1e-3, "y": torch.randn(1, generator=g)} for _ in range(STEPS * BATCH)]
    for i in range(CRASH * BATCH, (CRASH + 1) * BATCH):
        data[i]["x"] = torch.full((16,), 5.0)
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)


@pytest.fixture(scope="module")
def pl_run(tmp_path_factory):
    from lightning.pytorch.plugins import MixedPrecision

    from recorders.integrations.lightning import AmpAutopsyCallback

    run_dir = tmp_path_factory.mktemp("pl_exc") / "run"
    cb = AmpAutopsyCallback(run_dir, loss_fn="tests.recorders.test_exception_integrations:module_loss")
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(run_dir.parent),
                        plugins=[plugin], callbacks=[cb])
    with pytest.raises(FloatingPointError, match=f"non-finite loss inf at step {CRASH}") as e:
        trainer.fit(OverflowModule(), _pl_loader())
    return run_dir, cb, e.value


def test_a_lightning_training_step_that_raises_still_fails_with_its_own_exception(pl_run):
    _, cb, err = pl_run
    assert type(err) is FloatingPointError and cb.recorder.closed


def test_lightning_on_exception_keeps_the_step_as_an_exception_snapshot_and_in_meta_json(pl_run):
    run_dir, cb, _ = pl_run
    names = [p.name for p in (run_dir / "snapshots").iterdir()]
    assert names == [schema.snapshot_name(CRASH, 0, "exception")]
    snap = torch.load(run_dir / "snapshots" / names[0], weights_only=True)
    assert snap["exception"]["type"] == "FloatingPointError" and snap["scale"] == 256.0
    assert torch.equal(snap["batch"]["x"], torch.full((BATCH, 16), 5.0))
    for name, t in cb.recorder.model.state_dict().items():  # the optimizer never stepped on the crash step
        assert torch.equal(snap["model_state"][name], t)
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["exception"]["step"] == CRASH
    rows = pl.read_parquet(run_dir / "trace" / schema.STEPS_GLOB).sort("step")
    assert rows["step"].to_list() == list(range(CRASH + 1)) and rows["loss"][CRASH] is None


def test_the_lightning_report_and_autopsy_name_the_exception_the_overflow_and_the_verified_skip(pl_run):
    run_dir, _, _ = pl_run
    f = _exception_finding(run_dir)
    assert f.severity == "error" and f.step == CRASH and "FloatingPointError: non-finite loss inf" in f.message
    a = run_autopsy(str(run_dir), device="cpu")
    assert a.verdict == "overflow" and a.primary.step == CRASH
    assert (a.culprit["op"], a.culprit["module"], a.culprit["phase"]) == ("aten.addmm", "net.0", "forward")
    skip = [fx for _, fx in a.fixes if fx.name == "scaler_skip"]
    assert [fx.status for fx in skip] == ["verified"]
    assert "kept their pre-step values bit for bit, the scale backed off to 128" in skip[0].detail


# ------------------------------------------------------------------------------------------ HF Trainer
HF_SEQ, HF_EMBD, HF_VOCAB, HF_BATCH = 8, 16, 32, 2
# the crash is in HF's third optimizer step (state.global_step == CRASH while it runs), recorded in
# HF's own numbering: the global_step that step would end with (docs/recorder.md, step numbers)
HF_CRASH = CRASH + 1


class _Embeds(torch.utils.data.IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i in range(STEPS * HF_BATCH):
            x = torch.randn(HF_SEQ, HF_EMBD, generator=g)
            if i == CRASH * HF_BATCH + 1:
                x[3, 5] = float("nan")
            yield {"inputs_embeds": x, "labels": torch.randint(0, HF_VOCAB, (HF_SEQ,), generator=g)}


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    require("transformers", "hf")
    require("accelerate", "hf")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from recorders.integrations.hf import AmpAutopsyCallback

    class CheckedTrainer(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            value = loss[0] if isinstance(loss, tuple) else loss
            if not torch.isfinite(value):  # stop on a NaN loss, as many training scripts do
                raise FloatingPointError(f"NaN loss at step {self.state.global_step}")
            return loss

    root = tmp_path_factory.mktemp("hf_exc")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=HF_VOCAB, n_positions=HF_SEQ, n_embd=HF_EMBD, n_layer=1, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=str(root / "out"), use_cpu=True, max_steps=STEPS,
                             per_device_train_batch_size=HF_BATCH, learning_rate=1e-3, report_to=[],
                             save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0)
    cb = AmpAutopsyCallback(root / "run")
    trainer = CheckedTrainer(model=model, args=args, train_dataset=_Embeds(), callbacks=[cb])
    with pytest.raises(FloatingPointError, match=f"NaN loss at step {CRASH}") as e:
        with cb.guard():
            trainer.train()
    return root / "run", cb, e.value


def test_an_hf_run_under_guard_still_fails_with_its_own_exception_and_is_closed(hf_run):
    _, cb, err = hf_run
    assert type(err) is FloatingPointError and cb.recorder.closed and cb._handles == []


def test_hf_guard_keeps_the_step_with_the_loss_the_forward_returned(hf_run):
    run_dir, _, _ = hf_run
    snap = torch.load(run_dir / "snapshots" / schema.snapshot_name(HF_CRASH, 0, "exception"), weights_only=True)
    assert snap["exception"]["type"] == "FloatingPointError" and snap["amp_dtype"] is None
    assert torch.isnan(snap["batch"]["inputs_embeds"]).any()
    rows = pl.read_parquet(run_dir / "trace" / schema.STEPS_GLOB).sort("step")
    assert rows["step"].to_list() == list(range(1, HF_CRASH + 1))
    loss = rows["loss"][HF_CRASH - 1]
    assert loss is not None and loss != loss  # NaN: the callback's forward hook kept it
    assert rows["grad_norm"][HF_CRASH - 1] is None  # it raised in compute_loss, before backward


def test_the_hf_report_and_autopsy_name_the_exception_and_the_nan_batch(hf_run):
    run_dir, _, _ = hf_run
    f = _exception_finding(run_dir)
    assert f.step == HF_CRASH and "FloatingPointError: NaN loss at step 2" in f.message
    assert "its loss was nan" in f.message and "no gradients existed yet" in f.message
    assert f.evidence["first_nonfinite_loss_step"] == HF_CRASH
    a = run_autopsy(str(run_dir), device="cpu")
    assert a.verdict == "nonfinite_input" and a.primary.step == HF_CRASH
    assert a.primary.nonfinite_inputs == ["batch:inputs_embeds"]
    # FP32 is non-finite too: no GradScaler skip is offered for a NaN that is in the data
    assert not [fx for _, fx in a.fixes if fx.name == "scaler_skip" and fx.status == "verified"]

"""HF Trainer's ``torch_compile=True``: the callback records how the Trainer compiled the model it never sees compiled."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from analyzer.load import load_snapshot
from tests.recorders.test_integrations_hf import BATCH, STEPS, _Embeds, _gpt2

pytestmark = pytest.mark.compile


@pytest.mark.slow
def test_a_trainer_with_torch_compile_records_its_backend_and_mode_under_the_original_names(tmp_path):
    from transformers import Trainer, TrainingArguments

    from recorders.integrations.hf import AmpAutopsyCallback

    # aot_eager: this test is about what is recorded, not Inductor's numerics (and compiles in about a second)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=True, max_steps=STEPS, per_device_train_batch_size=BATCH,
        learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
        torch_compile=True, torch_compile_backend="aot_eager")
    cb = AmpAutopsyCallback(tmp_path / "run")
    trainer = Trainer(model=_gpt2(), args=args, train_dataset=_Embeds(), callbacks=[cb])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cb.guard():
            trainer.train()
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)  # the Trainer did compile it
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    entry = {"path": "", "how": "torch.compile", "backend": "aot_eager", "mode": "default", "dynamic": None,
             "fullgraph": False, "options": None}
    assert meta["compile"] == {"modules": [entry]}
    assert not any("_orig_mod" in p["name"] for p in meta["params"])
    # accelerate enters BF16 autocast inside the compiled forward: its casts are hidden in the compiled
    # graph, so the recorder cannot see it; it must say "not known", never "trains in FP32"
    assert not [w for w in caught if "autocast was not active" in str(w.message)]
    assert meta["autocast"]["enabled"] is None and "compiled graph" in meta["autocast"]["note"]
    snaps = sorted((tmp_path / "run" / "snapshots").glob("*.pt"))
    assert snaps, "the NaN batch's step writes a snapshot"
    assert load_snapshot(snaps[0]).compile == {"modules": [entry]}

"""HF Trainer's ``torch_compile=True``: the callback records how the Trainer compiled the model it never sees compiled."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from analyzer.load import load_snapshot
from tests.extras import require

require("transformers", "hf")
require("accelerate", "hf")
from tests.recorders.test_integrations_hf import BATCH, STEPS, _Embeds, _gpt2  # noqa: E402

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


# -- accelerate's regional compilation (compile_regions) --------------------------------------------
def _region_paths(compiled) -> list[str]:
    from recorders.compiled import compile_info

    return [m["path"] for m in compile_info(compiled)["modules"]]


@pytest.mark.parametrize("build", ["llama", "gpt2", "gate_stack", "mlp"])
def test_regions_are_the_modules_accelerates_compile_regions_compiles(build):
    """``regions`` on the uncompiled model against what compile_regions really wraps (torch.compile is lazy:
    nothing is compiled here)."""
    from accelerate.utils import compile_regions

    from recorders.integrations._hf_compile import regions
    from tests import hf_runs
    from tests.analyzer.replay import compile_models, replay_models

    model = {"llama": lambda: hf_runs.tiny_llama(layers=2), "gpt2": _gpt2, "gate_stack": compile_models.build_gate_stack,
             "mlp": replay_models.build_mlp}[build]()
    want = _region_paths(compile_regions(model, backend="aot_eager"))
    assert regions(model) == want
    if build == "mlp":  # no repeated blocks: compile_regions compiles the whole model
        assert want == [""]
    if build == "llama":
        assert {"model.layers.0", "model.layers.1", "lm_head"} <= set(want) and "" not in want


@pytest.mark.slow
def test_a_trainer_with_regional_compilation_records_each_region_and_the_replay_compiles_them(tmp_path, monkeypatch):
    from accelerate.utils import compile_regions
    from transformers import Trainer, TrainingArguments

    from analyzer.replay import Replay
    from recorders.integrations.hf import AmpAutopsyCallback

    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "1")  # read by the plugin the Trainer builds
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=STEPS, per_device_train_batch_size=BATCH,
        learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
        torch_compile=True, torch_compile_backend="aot_eager")
    cb = AmpAutopsyCallback(tmp_path / "run")
    trainer = Trainer(model=_gpt2(), args=args, train_dataset=_Embeds(), callbacks=[cb])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cb.guard():
            trainer.train()
    # what the Trainer ran: accelerate.prepare's compile_regions copy, blocks wrapped, the top level not
    assert not isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    ran = _region_paths(trainer.model_wrapped)
    assert len(ran) > 1 and "" not in ran
    assert ran == _region_paths(compile_regions(_gpt2(), backend="aot_eager"))
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert [m["path"] for m in meta["compile"]["modules"]] == ran
    assert {(m["how"], m["backend"]) for m in meta["compile"]["modules"]} == {("torch.compile", "aot_eager")}
    snaps = sorted((tmp_path / "run" / "snapshots").glob("*.pt"))
    assert snaps, "the NaN batch's step writes a snapshot"
    assert [m["path"] for m in load_snapshot(snaps[0]).compile["modules"]] == ran
    r = Replay(snaps[0], device="cpu").run()
    assert r.compiled["reproduced"], r.compiled["note"]
    assert [m["path"] for m in r.compiled["modules"]] == ran
    assert r.verdict == "nonfinite_input" and "eager verdict stands" in r.compiled["note"]


def test_a_compiled_only_nan_in_a_region_is_named_by_compiling_the_regions_as_training_did(tmp_path):
    """Inductor, compile_regions in a plain loop: the blocks one by one and the head. The compiled-only NaN
    of ``compile_models`` (an input of exactly 1) is born in ``blocks.0``; the replay compiles the three
    regions, then each alone, and names ``blocks.0``, not the whole model."""
    from accelerate.utils import compile_regions

    from analyzer.replay import Replay
    from recorders import Recorder
    from tests.analyzer.replay.compile_models import build_gate_stack, fresh_inductor, gate_batch, mse_loss

    models = "tests.analyzer.replay.compile_models"
    model = compile_regions(build_gate_stack())
    step_model, fresh = model._orig_mod, False  # compile_regions keeps the original module there
    for fresh in (False, True):  # a graph cached under another CPU capability builds when generated afresh
        try:
            with fresh_inductor(fresh):  # can Inductor build the kernels here, forward and backward?
                with torch.autocast("cpu", dtype=torch.float16):
                    probe = mse_loss(compile_regions(build_gate_stack()), gate_batch())
                probe.backward()
            step_model = model
            break
        except torch._dynamo.exc.BackendCompilerFailed:  # no C++ compiler: step eager, record the regions
            continue
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler, batch = torch.amp.GradScaler("cpu"), gate_batch()
    with Recorder(tmp_path / "run", model, factory=f"{models}:build_gate_stack", loss_fn=f"{models}:mse_loss",
                  scaler=scaler, amp_dtype=torch.float16, optimizer=opt) as rec:
        rec.begin_step(0, batch)
        with fresh_inductor(fresh and step_model is model):  # the backward graph compiles at backward()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = mse_loss(step_model, batch)
            scaler.scale(loss).backward()
        rec.end_step(loss)
        if step_model is not model:  # a finite eager step: snapshot it by hand
            rec.begin_step(1, batch)
            rec.snapshot()
    [path] = sorted((tmp_path / "run" / "snapshots").glob("*.pt"))
    assert [m["path"] for m in load_snapshot(path).compile["modules"]] == ["blocks.0", "blocks.1", "head"]
    r = Replay(path, device="cpu").run()
    assert r.runs["float16"]["finite"] and r.runs["float32"]["finite"]  # eager: finite
    if step_model is not model:  # no C++ compiler here: the eager verdict stands, marked
        assert r.compiled["reproduced"] is False and r.verdict == "healthy"
        return
    assert not torch.isfinite(loss)  # training's regional-compiled step went NaN
    assert r.verdict == "compile_specific" and r.compiled["module"] == "blocks.0"
    tried = [(t["module"], t["finite"]) for t in r.compiled["tried"]]
    assert tried == [("blocks.0", False), ("blocks.0.proj", True)]

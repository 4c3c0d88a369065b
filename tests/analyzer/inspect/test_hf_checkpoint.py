"""``analyzer inspect`` on the checkpoints frameworks write: HF Trainer ``checkpoint-N/`` directories
(tests/hf_runs.py: a tiny Llama trained at learning_rate=1e5, NaN from step 4) and a Lightning ``.ckpt``."""
from __future__ import annotations

import json
import shutil

import torch
from click.testing import CliRunner

from analyzer.cli import main
from analyzer.load import load_checkpoint
from tests.extras import require
from tests.hf_runs import first_nonfinite_grad_step, tiny_llama


def _inspect(*paths, json_out=True):
    res = CliRunner().invoke(main, ["inspect", *map(str, paths), *(["--json"] if json_out else [])])
    assert res.exit_code == 0, res.output
    return json.loads(res.output) if json_out else res.output


def _mapped_names(ckpt) -> list[str]:
    """The optimizer's parameter names in id order, as inspect mapped them."""
    [opt] = ckpt.optimizers
    return [n for g in opt.groups for n in g["params"]]


def test_inspect_reads_an_hf_checkpoint_dir_with_optimizer_state_by_name(hf_plain_run):
    d = hf_plain_run["out_dir"] / "checkpoint-3"
    ckpt = load_checkpoint(d)
    assert ckpt.layout == "hf_checkpoint" and ckpt.step == 3
    [opt] = ckpt.optimizers
    assert opt.mapping == "hf_trainer"
    # the live Trainer's optimizer, parameter by parameter: decay group first, then biases and norms
    assert _mapped_names(ckpt) == hf_plain_run["optimizer_names"]
    model_order = [n for n, _ in tiny_llama().named_parameters()]
    assert hf_plain_run["optimizer_names"] != model_order  # the groups reorder: a plain order guess is wrong
    slots = {(e.param, e.slot) for e in ckpt.entries if e.role == "optimizer"}
    assert ("model.norm.weight", "exp_avg_sq") in slots and ("lm_head.weight", "exp_avg") in slots
    weights = {e.name: e.tensor for e in ckpt.entries if e.role == "weight"}
    for e in ckpt.entries:
        if e.role == "optimizer" and e.slot == "exp_avg":
            assert e.tensor.shape == weights[e.param].shape


def test_inspect_text_of_a_checkpoint_dir_reports_the_side_files_briefly(hf_plain_run):
    text = _inspect(hf_plain_run["out_dir"] / "checkpoint-6", json_out=False)
    head = text.split("findings")[0]
    assert "names exact (HF Trainer's parameter groups)" in head
    assert "note: rng_state.pth skipped" in head and "note: training_args.bin skipped" in head
    assert "note: scheduler.pt: LR scheduler state at step 6" in head
    nan_step = first_nonfinite_grad_step(hf_plain_run)  # where the lr=1e5 run's rounding takes it (4 on AVX2/512)
    assert "note: trainer_state.json: global_step 6" in head and f"at step {nan_step}" in head
    assert "nonfinite_optimizer_state" in text and "optimizer.pt[model.embed_tokens.weight].exp_avg" in text


def test_the_ab_diff_takes_two_checkpoint_dirs(hf_plain_run):
    out = hf_plain_run["out_dir"]
    rep = _inspect(out / "checkpoint-3", out / "checkpoint-6")
    diff = rep["diff"]
    # the weights that hold NaN/Inf in checkpoint-6 and not in checkpoint-3, read independently
    from safetensors.torch import load_file

    a, b = load_file(out / "checkpoint-3" / "model.safetensors"), load_file(out / "checkpoint-6" / "model.safetensors")
    became = {n for n, t in b.items() if not t.isfinite().all() and a[n].isfinite().all()}
    assert {n for n in diff["became_nonfinite"] if not n.startswith("optimizer.pt[")} == became
    if first_nonfinite_grad_step(hf_plain_run) > 3:  # the run was still finite at checkpoint-3
        assert "model.embed_tokens.weight" in diff["became_nonfinite"]
        assert "optimizer.pt[model.norm.weight].exp_avg_sq" in diff["became_nonfinite"]
    assert diff["only_in_a"] == [] and diff["only_in_b"] == []


def test_a_pytorch_model_bin_checkpoint_dir_maps_the_same_names(hf_plain_run, tmp_path):
    d = shutil.copytree(hf_plain_run["out_dir"] / "checkpoint-3", tmp_path / "checkpoint-3")
    from safetensors.torch import load_file

    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")  # what save_safetensors=False writes
    (d / "model.safetensors").unlink()
    ckpt = load_checkpoint(d)
    assert ckpt.format == "torch" and ckpt.optimizers[0].mapping == "hf_trainer"
    assert _mapped_names(ckpt) == hf_plain_run["optimizer_names"]


def test_without_config_json_the_optimizer_ids_are_not_claimed_exact(hf_plain_run, tmp_path):
    d = shutil.copytree(hf_plain_run["out_dir"] / "checkpoint-3", tmp_path / "checkpoint-3")
    (d / "config.json").unlink()
    [opt] = load_checkpoint(d).optimizers
    assert opt.mapping in ("order", "none") and "no config.json" in opt.note


def test_a_directory_that_is_no_checkpoint_is_one_error_line(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    res = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert res.exit_code == 1
    assert res.output.strip().startswith("Error:") and "checkpoint-N/" in res.output


def test_a_lightning_ckpt_names_callback_tensors_by_class_not_by_repr(tmp_path):
    L = require("lightning", "lightning")
    from tests.recorders.test_integrations_lightning import TinyRegressor, _loader

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(TinyRegressor(), _loader())
    [path] = list(tmp_path.rglob("*.ckpt"))
    assert any("{" in k for k in torch.load(path, weights_only=True)["callbacks"])  # Lightning's repr-like key
    names = [t["name"] for t in _inspect(path)["files"][0]["tensors"]]
    assert "callbacks.ModelCheckpoint.kth_value" in names
    assert not [n for n in names if "{" in n or "'" in n]

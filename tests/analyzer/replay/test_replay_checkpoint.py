"""``analyzer replay CHECKPOINT --batch FILE`` (and ``autopsy``): runs that had no recorder.

Each test writes the files a user has after a crash: a ``state_dict`` (or an HF ``save_pretrained``
directory, or a Lightning ``.ckpt``) and the failing step's batch saved with ``torch.save``.
"""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main
from analyzer.replay import replay_snapshot
from tests.extras import require

from . import replay_models as rm


def _cli(*args):
    return CliRunner().invoke(main, [*map(str, args)])


def _json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


def _where(obj) -> tuple:
    c = obj["culprit"]
    return obj["verdict"], c["op"], c["module"], c["phase"]


# The three failure kinds, each one real step of replay_models. Why each fails is said where the
# shared fixtures of the same steps are (tests/analyzer/conftest.py).
def _attention():
    g = torch.Generator().manual_seed(0)
    return ("build_attention", "attention_mse", {"d": 8, "gain": 8.0},
            {"x": torch.randn(2, 8, 8, generator=g) * 10, "y": torch.randn(2, 8, 1, generator=g)})


def _log_zero():
    return ("build_classifier", "log_prob_loss", {},
            {"x": torch.tensor([[2.0, 0, 0, 0], [1.0, 0, 0, 0]]), "y": torch.tensor([2, 0])})


def _zero_row():
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    x[1] = 0.0
    return "build_norm", "mean_loss", {}, {"x": x}


@pytest.mark.parametrize("case, expected", [
    (_attention, ("overflow", "aten.bmm", "attn", "forward")),          # a forward overflow
    (_log_zero, ("numerical_bug", "aten.log", "<loss_fn>", "forward")),  # log(0): a bug in FP32 too
    (_zero_row, ("numerical_bug", None, "norm", "backward")),            # sqrt'(0): born in backward
])
def test_a_state_dict_and_a_saved_batch_give_the_recorder_snapshots_verdict_op_module_and_phase(
        tmp_path, case, expected):
    factory, loss_fn, kwargs, batch = case()
    sd_file, batch_file = tmp_path / "model.pt", tmp_path / "batch.pt"

    def save_checkpoint(model):  # what the loop saved: the weights the failing step starts from
        torch.save(model.state_dict(), sd_file)

    with torch.random.fork_rng():
        torch.manual_seed(0)
        snap = rm.record_step(tmp_path / "run", factory=factory, loss_fn=loss_fn, factory_kwargs=kwargs,
                              batch=batch, amp_dtype=torch.float16, inject=save_checkpoint)
    torch.save(batch, batch_file)
    recorded = replay_snapshot(snap).to_dict()
    # the factory is called with no arguments: the weights, not the kwargs, carry the fault
    got = _json(_cli("replay", sd_file, "--batch", batch_file, "--factory", f"{rm.REF}:{factory}",
                     "--loss-fn", f"{rm.REF}:{loss_fn}", "--json"))
    assert _where(got) == _where(recorded)
    verdict, op, module, phase = expected
    assert (got["verdict"], got["culprit"]["module"], got["culprit"]["phase"]) == (verdict, module, phase)
    assert op is None or got["culprit"]["op"] == op
    assert got["checkpoint"]["kind"] == "state_dict" and got["amp_dtype"] == "float16"
    assert got["scale"] == 65536.0  # FP16 without a recorded scale: GradScaler's default init_scale


def test_the_text_output_names_every_default_that_stood_in_for_the_snapshot(tmp_path):
    factory, loss_fn, _, batch = _attention()
    torch.save(rm.build_attention(d=8, gain=8.0).state_dict(), tmp_path / "m.pt")
    torch.save(batch, tmp_path / "b.pt")
    res = _cli("replay", tmp_path / "m.pt", "--batch", tmp_path / "b.pt", "--amp", "bf16",
               "--factory", f"{rm.REF}:{factory}", "--loss-fn", f"{rm.REF}:{loss_fn}")
    assert res.exit_code == 0, res.output
    out = res.output
    assert "amp dtype bfloat16, loss scale 1" in out
    assert "NB: AMP dtype bfloat16 (--amp)" in out
    assert "NB: loss scale 1 (BF16 trains without a GradScaler" in out
    assert "no recorded loss scale, RNG state or pre-step buffers were available" in out
    assert "fixed seed (0)" in out


def test_a_plain_state_dict_without_factory_says_to_pass_it(tmp_path):
    torch.save(rm.build_mlp().state_dict(), tmp_path / "m.pt")
    torch.save({"x": torch.ones(2, 4)}, tmp_path / "b.pt")
    line = _one_error_line(_cli("replay", tmp_path / "m.pt", "--batch", tmp_path / "b.pt"))
    assert "m.pt: a plain state_dict does not say which model" in line and "--factory" in line


def test_a_plain_state_dict_with_factory_but_no_loss_fn_says_to_pass_it(tmp_path):
    torch.save(rm.build_mlp().state_dict(), tmp_path / "m.pt")
    torch.save({"x": torch.ones(2, 4)}, tmp_path / "b.pt")
    line = _one_error_line(_cli("replay", tmp_path / "m.pt", "--batch", tmp_path / "b.pt",
                                "--factory", "tests.analyzer.replay.replay_models:build_mlp"))
    assert "m.pt: a plain state_dict does not say which loss it belongs to (pass --loss-fn" in line


def test_a_checkpoint_without_batch_says_to_pass_one_with_the_recipe(tmp_path):
    torch.save({"model": rm.build_mlp().state_dict(), "step": 3}, tmp_path / "ckpt.pt")
    line = _one_error_line(_cli("replay", tmp_path / "ckpt.pt"))
    assert "not an amp-autopsy snapshot" in line and "--batch FILE" in line and "save_batch_on_nan" in line


def test_replay_help_shows_the_recipe_for_saving_the_batch():
    res = _cli("replay", "--help")
    assert res.exit_code == 0
    text = " ".join(res.output.split())
    assert "torch.save(batch, 'batch.pt')" in text and "save_batch_on_nan" in text and "--batch FILE" in text


# -- a pickled nn.Module, as the checkpoint or as the batch --------------------------------------
@pytest.mark.parametrize("which", ["checkpoint", "batch"])
def test_a_pickled_module_as_checkpoint_or_batch_is_refused_with_one_error_line(tmp_path, which):
    good_ck, good_batch = tmp_path / "m.pt", tmp_path / "b.pt"
    torch.save(rm.build_mlp().state_dict(), good_ck)
    torch.save({"x": torch.ones(2, 4), "y": torch.ones(2, 1)}, good_batch)
    evil = tmp_path / "evil.pt"
    torch.save(rm.build_mlp(), evil)  # the whole nn.Module: loading it would run its class's code
    ck, batch = (evil, good_batch) if which == "checkpoint" else (good_ck, evil)
    line = _one_error_line(_cli("replay", ck, "--batch", batch, "--factory", f"{rm.REF}:build_mlp",
                                "--loss-fn", f"{rm.REF}:mse"))
    assert str(evil) in line and "pickled Python objects" in line


# -- an HF save_pretrained directory -------------------------------------------------------------
def _gpt2_with_mlp_overflow(out):
    """A 2-block GPT-2 built from a config; block 1's MLP overflows FP16: ln_2's bias 100 and c_fc
    weights 50 give 16 * 100 * 50 = 8e4 > 65504 in c_fc's addmm, finite in FP32."""
    transformers = require("transformers", "hf")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        model.transformer.h[1].ln_2.bias.fill_(100.0)
        model.transformer.h[1].mlp.c_fc.weight.fill_(50.0)
    model.save_pretrained(out)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    batch = _gpt2_with_mlp_overflow(d / "checkpoint-40")
    torch.save(batch, d / "batch.pt")
    return d


def test_an_hf_save_pretrained_directory_replays_to_overflow_in_its_mlp_without_factory(hf_dir):
    got = _json(_cli("replay", hf_dir / "checkpoint-40", "--batch", hf_dir / "batch.pt", "--json"))
    assert got["verdict"] == "overflow"
    assert got["culprit"]["module"].startswith("transformer.h.1.mlp")
    assert got["culprit"]["phase"] == "forward"
    assert got["checkpoint"]["kind"] == "hf"
    assert any("lm_head.weight" in n for n in got["checkpoint"]["notes"])  # tied to the embeddings, not saved


def test_an_hf_trainer_checkpoint_autopsy_reports_its_trainer_state_and_replays_its_batch(hf_dir, tmp_path):
    import shutil

    ck = shutil.copytree(hf_dir / "checkpoint-40", tmp_path / "checkpoint-40")
    state = {"global_step": 40, "log_history": [{"step": s, "loss": 3.0 - 0.01 * s, "grad_norm": 1.0,
                                                 "learning_rate": 1e-3} for s in range(1, 41)]}
    (ck / "trainer_state.json").write_text(json.dumps(state))
    got = _json(_cli("autopsy", ck, "--batch", hf_dir / "batch.pt", "--json"))
    assert got["verdict"] == "overflow"
    assert got["report"]["source_format"] == "hf_trainer_state"
    assert got["replays"][0]["step"] == 40  # the step after the checkpoint's 40 optimizer steps
    assert got["culprit"]["module"].startswith("transformer.h.1.mlp")


def test_autopsy_of_a_checkpoint_without_logs_answers_from_the_replay_alone(hf_dir):
    res = _cli("autopsy", hf_dir / "checkpoint-40", "--batch", hf_dir / "batch.pt")
    assert res.exit_code == 0, res.output
    assert "verdict: overflow" in res.output
    assert "evidence 1/2: no report" in res.output and "holds no training log" in res.output
    assert "step None" not in res.output  # a save_pretrained directory records no step: none is claimed
    assert "verified fix: switch from FP16 to BF16: the step runs finite in bfloat16" in res.output
    got = _json(_cli("autopsy", hf_dir / "checkpoint-40", "--batch", hf_dir / "batch.pt", "--json"))
    assert got["report"] is None and got["verdict"] == "overflow"


# -- a Lightning .ckpt ---------------------------------------------------------------------------
_MODULE = '''
import torch
import lightning.pytorch as pl
from torch import nn


class TinyRegressor(pl.LightningModule):
    def __init__(self, d: int = 4, gain: float = 1.0):
        super().__init__()
        self.save_hyperparameters()
        self.fc = nn.Linear(d, 1)
        with torch.no_grad():
            self.fc.weight.fill_(gain)

    def forward(self, x):
        return self.fc(x)

    def training_step(self, batch, batch_idx):
        return ((self(batch["x"]).float() - batch["y"]) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)
'''


def test_a_lightning_ckpt_replays_without_factory_with_its_class_found_under_path(tmp_path, monkeypatch):
    pl = require("lightning.pytorch", "lightning")
    code = tmp_path / "code"
    code.mkdir()
    (code / "i27_tiny_module.py").write_text(textwrap.dedent(_MODULE))
    monkeypatch.syspath_prepend(str(code))
    from i27_tiny_module import TinyRegressor

    # gain 300 with inputs 300: 4 * 300 * 300 = 3.6e5 > 65504 in fc's FP16 addmm, finite in FP32
    module = TinyRegressor(d=4, gain=300.0)
    data = [{"x": torch.ones(4), "y": torch.zeros(1)} for _ in range(4)]
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    work = tmp_path / "work"
    work.mkdir()
    trainer.save_checkpoint(work / "last.ckpt")
    torch.save({"x": torch.full((2, 4), 300.0), "y": torch.zeros(2, 1)}, work / "batch.pt")
    monkeypatch.chdir(work)  # the class lives in code/, beside it, not under it: --path names it
    missing = _one_error_line(_cli("replay", "last.ckpt", "--batch", "batch.pt"))
    assert "does not name its LightningModule class" in missing and "--path" in missing
    got = _json(_cli("replay", "last.ckpt", "--batch", "batch.pt", "--path", code, "--json"))
    assert (got["verdict"], got["culprit"]["module"], got["culprit"]["phase"]) == ("overflow", "fc", "forward")
    assert got["checkpoint"]["kind"] == "lightning" and got["step"] == 1
    assert any("i27_tiny_module:TinyRegressor" in n for n in got["checkpoint"]["notes"])


def _lightning_files(tmp_path, monkeypatch, hparams, name):
    """A hand-written Lightning checkpoint (the keys Trainer.save_checkpoint writes) of CliRegressor in
    module `name` (one name per test: a module another test imported would shadow it)."""
    import importlib

    require("lightning.pytorch", "lightning")
    code = tmp_path / "code"
    code.mkdir()
    (code / f"{name}.py").write_text(textwrap.dedent(_MODULE).replace("TinyRegressor", "CliRegressor"))
    monkeypatch.syspath_prepend(str(code))
    module = importlib.import_module(name).CliRegressor(d=4, gain=300.0)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": hparams, "global_step": 7,
                "pytorch-lightning_version": "2.6.6"}, tmp_path / "cli.ckpt")
    torch.save({"x": torch.full((2, 4), 300.0), "y": torch.zeros(2, 1)}, tmp_path / "batch.pt")
    return code


def test_a_lightning_cli_class_path_names_the_class_and_the_import_rule_still_decides(tmp_path, monkeypatch):
    code = _lightning_files(tmp_path, monkeypatch, {"d": 4, "gain": 300.0, "_class_path": "i27_cli_a.CliRegressor"},
                            "i27_cli_a")
    monkeypatch.chdir(tmp_path)
    refused = _one_error_line(_cli("replay", "cli.ckpt", "--batch", "batch.pt"))  # on sys.path, not under a root
    assert "i27_cli_a" in refused and "--path" in refused
    got = _json(_cli("replay", "cli.ckpt", "--batch", "batch.pt", "--path", code, "--json"))
    assert (got["verdict"], got["culprit"]["module"], got["step"]) == ("overflow", "fc", 7)


def test_two_lightning_classes_fitting_the_hyperparameters_ask_for_factory(tmp_path, monkeypatch):
    code = _lightning_files(tmp_path, monkeypatch, {"d": 4, "gain": 300.0}, "i27_cli_b")
    (code / "i27_other_module.py").write_text(textwrap.dedent(_MODULE).replace("TinyRegressor", "OtherRegressor"))
    monkeypatch.chdir(tmp_path)
    line = _one_error_line(_cli("replay", "cli.ckpt", "--batch", "batch.pt", "--path", code))
    assert "2 under" in line and "i27_other_module:OtherRegressor" in line and "--factory" in line
    got = _json(_cli("replay", "cli.ckpt", "--batch", "batch.pt", "--factory", "i27_cli_b:CliRegressor",
                     "--json"))  # the user's say-so: called with the checkpoint's hyperparameters
    assert got["verdict"] == "overflow" and got["culprit"]["module"] == "fc"


def test_an_hf_checkpoint_with_nan_weights_and_its_optimizer_pt_gets_the_update_forensics(tmp_path):
    """AdamW with eps=0, the Trainer's two parameter groups: position-embedding rows 8..15, which a
    length-8 batch never reads (and row 7, whose output no loss term uses), get a zero gradient, so exp_avg = exp_avg_sq = 0 and their update is
    0 / (0 + 0) = NaN."""
    transformers = require("transformers", "hf")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    groups = [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.0},
              {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, eps=0.0)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert torch.isnan(model.transformer.wpe.weight[8:]).all()  # (row 7 too: no later position attends to it)
    ck = tmp_path / "checkpoint-1"
    model.save_pretrained(ck)
    torch.save(opt.state_dict(), ck / "optimizer.pt")
    torch.save({"input_ids": ids, "labels": ids}, tmp_path / "batch.pt")
    got = _json(_cli("replay", ck, "--batch", tmp_path / "batch.pt", "--json"))
    assert got["verdict"] == "underflow" and got["culprit"]["phase"] == "optimizer"  # eps 0: sqrt(v) + eps == 0
    assert got["update"]["optimizer"] == "AdamW"
    assert "transformer.wpe.weight" in {p["name"] for p in got["update"]["params"]}
    assert any("optimizer state: optimizer.pt" in n for n in got["checkpoint"]["notes"])


def test_a_loop_checkpoint_with_nan_weights_and_its_optimizer_state_gets_the_update_forensics(tmp_path):
    """A pure-FP16 model under Adam(eps=1e-8): eps is 0 in float16, and the weight column that input
    column 0 (all zeros) feeds gets a zero gradient (so do dead ReLU units), so its update is 0 / (0 + 0) = NaN."""
    model = rm.build_mlp().half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(8, 4, generator=g).half(), "y": torch.randn(8, 1, generator=g).half()}
    batch["x"][:, 0] = 0.0
    rm.mse(model, batch).backward()
    opt.step()
    assert torch.isnan(model[0].weight[:, 0]).all()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}, tmp_path / "ckpt.pt")
    torch.save(batch, tmp_path / "batch.pt")
    got = _json(_cli("replay", tmp_path / "ckpt.pt", "--batch", tmp_path / "batch.pt",
                     "--factory", f"{rm.REF}:build_mlp", "--loss-fn", f"{rm.REF}:mse", "--json"))
    assert got["verdict"] == "underflow" and got["culprit"]["phase"] == "optimizer"
    assert got["update"]["optimizer"] == "Adam" and got["step"] == 1
    assert "0.weight" in {p["name"] for p in got["update"]["params"]}  # (dead ReLU units zero more gradients)
    assert any("model's named_parameters() order" in n for n in got["checkpoint"]["notes"])

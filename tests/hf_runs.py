"""Real HF Trainer runs shared by the tests (``tests/conftest.py`` trains each once per session).

A tiny ``LlamaForCausalLM`` built from a config (no download), BF16 CPU autocast, HF's default
``max_grad_norm=1.0`` and ``logging_nan_inf_filter=True``, ``logging_steps=1`` and a checkpoint
every ``SAVE_EVERY`` steps. ``learning_rate=1e5`` blows the weights up at the first update, so the
gradients go NaN a step or two later: the failure HF logs as ``grad_norm: nan``.

Each run is a dict: ``run_dir`` (the Recorder's, or None), ``out_dir`` (the Trainer's
``output_dir``), ``log_history`` (HF's, from the Trainer's state), ``callback``, ``warnings`` (caught while
training), ``optimizer_names`` (the live optimizer's parameter names in id order).
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch

STEPS = 6
SAVE_EVERY = 3
BATCH = 2
SEQ, VOCAB, HIDDEN = 8, 32, 16
LR_BLOWUP = 1e5


def tiny_llama(layers: int = 1):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
                      bos_token_id=0, eos_token_id=1, pad_token_id=None)
    return LlamaForCausalLM(cfg)


class TokenData(torch.utils.data.IterableDataset):
    """Fixed token batches (iterable: the Trainer neither shuffles nor drops it)."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(self.n):
            ids = torch.randint(2, VOCAB, (SEQ,), generator=g)
            yield {"input_ids": ids, "labels": ids.clone()}


class NoTargetData(TokenData):
    """``TokenData`` whose example number `at` has every label -100: a batch of one with no target tokens."""

    def __init__(self, n: int, at: int):
        super().__init__(n)
        self.at = at

    def __iter__(self):
        for i, ex in enumerate(super().__iter__()):
            yield {"input_ids": ex["input_ids"], "labels": torch.full_like(ex["labels"], -100)} if i == self.at else ex


def train_hf(root: Path, *, record: bool = True, accumulation: int = 1, lr: float = LR_BLOWUP,
             steps: int = STEPS, trainer_cls=None, batch: int = BATCH, dataset=None, layers: int = 1,
             **callback_kwargs) -> dict:
    """Train the tiny Llama with the Trainer (with the amp-autopsy callback unless `record` is False)."""
    from transformers import Trainer, TrainingArguments

    from recorders.integrations.hf import AmpAutopsyCallback

    out_dir, run_dir = root / "out", root / "run"
    args = TrainingArguments(
        output_dir=str(out_dir), use_cpu=True, bf16=True, max_steps=steps, learning_rate=lr,
        per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, report_to=[],
        logging_steps=1, save_strategy="steps", save_steps=SAVE_EVERY, disable_tqdm=True, seed=0,
        lr_scheduler_type="constant",
    )
    callbacks = [AmpAutopsyCallback(run_dir, **callback_kwargs)] if record else []
    with warnings.catch_warnings(record=True) as caught, torch.random.fork_rng():
        warnings.simplefilter("always")
        trainer = (trainer_cls or Trainer)(model=tiny_llama(layers), args=args, train_dataset=dataset or TokenData(steps * batch * accumulation),
                          callbacks=callbacks)
        trainer.train()
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return {"run_dir": run_dir if record else None, "out_dir": out_dir,
            "log_history": list(trainer.state.log_history), "callback": callbacks[0] if record else None,
            "warnings": [w for w in caught],
            # the live optimizer's parameters in id order (param_groups order): what optimizer.pt's ids mean
            "optimizer_names": [names[id(p)] for g in trainer.optimizer.param_groups for p in g["params"]]}


def logged_steps(run: dict) -> list[dict]:
    """HF's per-step log entries (those with a training loss), in step order."""
    return [e for e in run["log_history"] if "loss" in e and "step" in e]


def first_nonfinite_grad_step(run: dict) -> int | None:
    """The first step HF logged a NaN/Inf ``grad_norm`` at."""
    return next((e["step"] for e in logged_steps(run) if not math.isfinite(e.get("grad_norm", 0.0))), None)

"""Recorded steps and runs that several analyzer test files read: each is trained once per session.

No test trains the same scenario twice. A fixture here is a real step recorded by the
real ``Recorder`` (``replay/replay_models.py``, ``replay/fix_models.py``) or a short real run
(``autopsy/autopsy_runs.py``), trained on first use into a session temporary folder. Tests only
read them (replay, fixes, report and autopsy never write into their input); a test that moves or
writes into a run copies it first (``copy_run``).

Each fixture says what the step is and why it fails, once; the tests that read it pin what they
check about it.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from .replay import fix_models as fm
from .replay import replay_models as rm


def _seeded(make):
    """Run `make` with the global RNG at seed 0 and put the tests' RNG back as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return make()


def copy_run(src: Path, dst: Path) -> Path:
    """A private copy of a shared run directory, for a test that moves or writes into it."""
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="session")
def fp16_attention_step(tmp_path_factory) -> Path:
    """One FP16-autocast step of ``build_attention(d=8, gain=8)``: with inputs ~10, the unscaled
    logits are ~1e5 > 65504, so ``q @ k^T`` overflows in the attention module's forward."""
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(2, 8, 8, generator=g) * 10, "y": torch.randn(2, 8, 1, generator=g)}
    return _seeded(lambda: rm.record_step(
        tmp_path_factory.mktemp("fp16_attention") / "run", factory="build_attention", loss_fn="attention_mse",
        factory_kwargs={"d": 8, "gain": 8.0}, batch=batch, amp_dtype=torch.float16))


@pytest.fixture(scope="session")
def fp16_attention_replay(fp16_attention_step):
    """``fp16_attention_step`` replayed in FP32, FP16 and BF16 (the result is only read)."""
    from analyzer.replay import replay_snapshot

    return replay_snapshot(fp16_attention_step, dtypes=["fp32", "fp16", "bf16"])


@pytest.fixture(scope="session")
def healthy_mlp_step(tmp_path_factory) -> Path:
    """A healthy FP16 step of ``build_mlp``, snapshotted by hand (``manual``)."""
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(4, 4, generator=g), "y": torch.randn(4, 1, generator=g)}
    return _seeded(lambda: rm.record_step(
        tmp_path_factory.mktemp("healthy_mlp") / "run", factory="build_mlp", loss_fn="mse", batch=batch,
        amp_dtype=torch.float16, manual=True))


@pytest.fixture(scope="session")
def log_zero_step(tmp_path_factory) -> Path:
    """An FP16 step of ``build_classifier`` (gain 100) whose loss takes log(softmax(x))[y]: the logits
    (200, 0, -200) give p(class 2) = exp(-400), exactly 0 even in FP32, and log(0) = -inf."""
    batch = {"x": torch.tensor([[2.0, 0, 0, 0], [1.0, 0, 0, 0]]), "y": torch.tensor([2, 0])}
    return _seeded(lambda: rm.record_step(
        tmp_path_factory.mktemp("log_zero") / "run", factory="build_classifier", loss_fn="log_prob_loss",
        batch=batch, amp_dtype=torch.float16))


@pytest.fixture(scope="session")
def zero_row_norm_step(tmp_path_factory) -> Path:
    """An FP16 step of ``build_norm`` whose batch row 1 is all zeros: sqrt'(0) is infinite in backward."""
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    x[1] = 0.0
    return _seeded(lambda: rm.record_step(
        tmp_path_factory.mktemp("zero_row_norm") / "run", factory="build_norm", loss_fn="mean_loss",
        batch={"x": x}, amp_dtype=torch.float16))


@pytest.fixture(scope="session")
def scaled_sum_mse_step(tmp_path_factory) -> Path:
    """A clean FP16 ``build_mlp`` step at loss scale 65536 with a sum-reduced MSE and |out - y| ~ 3:
    dloss/dout * 65536 ~ 4e5 does not fit FP16 (a loss-scale overflow)."""
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(4, 4, generator=g), "y": torch.randn(4, 1, generator=g) + 3}
    return _seeded(lambda: rm.record_step(
        tmp_path_factory.mktemp("scaled_sum_mse") / "run", factory="build_mlp", loss_fn="sum_mse", batch=batch,
        amp_dtype=torch.float16, init_scale=65536.0, manual=True))


@pytest.fixture(scope="session")
def bce_step(tmp_path_factory) -> Path:
    """The hand-written BCE: one real FP16 step with a logit of 10 and label 0, where
    1 - sigmoid(10) rounds to 0 in FP16 and log(0) = -inf."""
    return _seeded(lambda: fm.record(tmp_path_factory.mktemp("bce") / "run", factory="build_logit",
                                     loss_fn="bce_loss", batch=fm.bce_batch(), amp_dtype=torch.float16))


@pytest.fixture(scope="session")
def inf_target_run(tmp_path_factory) -> Path:
    """``autopsy_runs.record_inf_target_run``: an FP32 MLP whose target holds an inf at INF_STEP."""
    from .autopsy.autopsy_runs import record_inf_target_run

    return _seeded(lambda: record_inf_target_run(tmp_path_factory.mktemp("inf_target") / "run"))

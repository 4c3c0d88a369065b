"""Shared pytest setup: deterministic, single-threaded torch so the suite behaves on 2 cores.

Also the session's shared recordings of ``tests/update_runs.py`` (no test trains the
same scenario twice): each run is trained once, on first use, and only read by the tests (a test
that writes into a run directory copies it first).
"""
from __future__ import annotations

import pytest
import torch


def pytest_configure(config):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def _recorded(factory: pytest.TempPathFactory, name: str, record, **kwargs) -> dict:
    with torch.random.fork_rng():  # the runs seed nothing global; keep them off the tests' RNG
        torch.manual_seed(0)
        return record(factory.mktemp(name) / "run", **kwargs)


@pytest.fixture(scope="session")
def fp16_adam_eps_update_run(tmp_path_factory) -> dict:
    """``update_runs.record_fp16_adam_eps(check_update=True)``: its info dict (run_dir, snapshots...)."""
    from tests import update_runs

    return _recorded(tmp_path_factory, "fp16_adam_eps_update", update_runs.record_fp16_adam_eps, check_update=True)


@pytest.fixture(scope="session")
def clip_inf_update_run(tmp_path_factory) -> dict:
    """``update_runs.record_clip_inf(check_update=True)``: its info dict."""
    from tests import update_runs

    return _recorded(tmp_path_factory, "clip_inf_update", update_runs.record_clip_inf, check_update=True)


@pytest.fixture(scope="session")
def fp16_adam_eps_run(tmp_path_factory) -> dict:
    """``update_runs.record_fp16_adam_eps()`` without check_update: its info dict."""
    from tests import update_runs

    return _recorded(tmp_path_factory, "fp16_adam_eps", update_runs.record_fp16_adam_eps)


@pytest.fixture(scope="session")
def bf16_stall_run(tmp_path_factory) -> dict:
    """``update_runs.record_bf16_stall()``: a pure-BF16 MLP whose ``2.weight`` never changes."""
    from tests import update_runs

    return _recorded(tmp_path_factory, "bf16_stall", update_runs.record_bf16_stall)


@pytest.fixture(scope="session")
def fp32_stall_run(tmp_path_factory) -> dict:
    """``update_runs.record_fp32_stall()``: the same model and data in FP32, every layer changing."""
    from tests import update_runs

    return _recorded(tmp_path_factory, "fp32_stall", update_runs.record_fp32_stall)


# ---------------------------------------------------------------- HF Trainer runs (tests/hf_runs.py)
def _hf_run(factory: pytest.TempPathFactory, name: str, **kwargs) -> dict:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tests import hf_runs

    return hf_runs.train_hf(factory.mktemp(name), **kwargs)


@pytest.fixture(scope="session")
def hf_blowup_run(tmp_path_factory) -> dict:
    """``hf_runs.train_hf``: a tiny Llama at learning_rate=1e5 with the amp-autopsy callback."""
    return _hf_run(tmp_path_factory, "hf_blowup")


@pytest.fixture(scope="session")
def hf_blowup_accum_run(tmp_path_factory) -> dict:
    """The same with gradient_accumulation_steps=2."""
    return _hf_run(tmp_path_factory, "hf_blowup_accum", accumulation=2)


@pytest.fixture(scope="session")
def hf_plain_run(tmp_path_factory) -> dict:
    """The same run without the recorder: only HF's own output_dir (checkpoints, trainer_state.json)."""
    return _hf_run(tmp_path_factory, "hf_plain", record=False)

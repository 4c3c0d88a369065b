"""Shared pytest setup: deterministic, single-threaded torch so the suite behaves on 2 cores.

Also the session's shared recordings of ``tests/update_runs.py`` (no test trains the
same scenario twice): each run is trained once, on first use, and only read by the tests (a test
that writes into a run directory copies it first).
"""
from __future__ import annotations

import pytest
import torch

from tests.extras import CACHE_KEY, require, skipped_for_an_extra


def pytest_configure(config):
    torch.set_num_threads(1)


# ---------------------------------------------------------------- tests skipped for a missing extra (tests/extras.py)
def pytest_addoption(parser):
    parser.addoption("--skipped-for-extras", action="store_true",
                     help="run only the tests the last run skipped because an optional extra was not installed")


_skipped_for_extras: list[str] = []


def pytest_runtest_logreport(report):
    if skipped_for_an_extra(report):
        _skipped_for_extras.append(report.nodeid)


def pytest_collectreport(report):
    if skipped_for_an_extra(report):  # a module that skips as a whole at import
        _skipped_for_extras.append(report.nodeid)


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--skipped-for-extras"):
        return
    wanted = config.cache.get(CACHE_KEY, None) if getattr(config, "cache", None) is not None else None
    if not wanted:
        raise pytest.UsageError("--skipped-for-extras: the last run skipped no test for a missing extra "
                                "(run `python -m pytest` without the extras first, with pytest's cache on)")
    keep = [i for i in items if any(i.nodeid == w or i.nodeid.startswith(w + "::") for w in wanted)]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if config.getoption("--skipped-for-extras"):
        if _skipped_for_extras:  # the extras were meant to be installed by now
            print(f"\n--skipped-for-extras: still skipped for a missing extra: {sorted(set(_skipped_for_extras))}")
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif getattr(config, "cache", None) is not None:
        config.cache.set(CACHE_KEY, sorted(set(_skipped_for_extras)))


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
    require("transformers", "hf")
    require("accelerate", "hf")
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


@pytest.fixture(scope="session")
def ddp_runs(tmp_path_factory) -> dict:
    """The 2-rank DDP runs of ``tests/ddp_runs.py`` (one spawn): {name: run directory}."""
    from tests.ddp_runs import record_ddp_runs

    return record_ddp_runs(tmp_path_factory.mktemp("ddp_hooks"))

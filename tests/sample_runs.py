"""One training run per sample scenario per test session, shared by every test that reads it.

The scenarios are real training runs (FP16 and BF16 are slow on CPU), and three test files
read the same runs: each is trained once, on first use, into a session temporary folder. Tests
only read a run (report, replay), so sharing it cannot couple them.
"""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

__all__ = ["sample_run"]

_RUNS: dict[tuple, Path] = {}


def sample_run(factory: pytest.TempPathFactory, name: str, **kwargs) -> Path:
    """The run directory of ``samples.<name>.run(..., **kwargs)``, trained on first use."""
    key = (name, tuple(sorted(kwargs.items())))
    if key not in _RUNS:
        module = importlib.import_module(f"samples.{name}")
        _RUNS[key] = module.run(factory.mktemp(name) / "run", **kwargs)
    return _RUNS[key]

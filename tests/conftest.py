"""Shared pytest setup: deterministic, single-threaded torch so the suite behaves on 2 cores."""
from __future__ import annotations

import pytest
import torch


def pytest_configure(config):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield

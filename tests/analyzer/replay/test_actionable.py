"""``_actionable``: which source lines are an installed library's, and what a batch without targets looks like."""
from __future__ import annotations

import os

import pytest
import torch

from analyzer.replay.detection._actionable import batch_fault, installed_line, library_of

_DIV = {"op": "aten.div", "phase": "forward", "output_kind": "nan"}


@pytest.mark.parametrize("source, installed", [
    (".venv/lib/python3.11/site-packages/transformers/loss/loss_utils.py:47", True),
    ("/usr/lib/python3/dist-packages/foo/bar.py:3", True),
    (os.path.join(os.path.dirname(torch.__file__), "nn", "functional.py") + ":10", True),
    (os.path.join(os.path.dirname(os.__file__), "statistics.py") + ":5", True),  # the standard library
    ("tests/analyzer/replay/cancel_models.py:43", False),
    ("samples/models.py:98", False),
    (None, False),
])
def test_an_installed_library_line_is_told_from_the_users_own(source, installed):
    assert installed_line(source) is installed


def test_the_library_named_is_the_package_under_site_packages():
    assert library_of(".venv/lib/python3.11/site-packages/transformers/loss/loss_utils.py:47") == "transformers"


@pytest.mark.parametrize("labels, fault", [
    (torch.full((1, 8), -100), "every label is -100 in the batch entry `labels`"),
    (torch.tensor([[5] + [-100] * 7]), "every label after the first position is -100"),
    (torch.tensor([[5, 6] + [-100] * 6]), None),  # one target token is left after the shift
])
def test_a_batch_without_target_tokens_is_named_when_the_loss_is_0_over_0(labels, fault):
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "labels": labels,
             "num_items_in_batch": torch.tensor(0.0)}
    got = batch_fault(batch, _DIV)
    assert (got is None) if fault is None else (fault in got and "(num_items_in_batch = 0)" in got)


@pytest.mark.parametrize("culprit", [
    {**_DIV, "phase": "backward"}, {**_DIV, "output_kind": "inf"}, {**_DIV, "op": "aten.sqrt"}, None])
def test_the_batch_is_not_blamed_for_other_culprits(culprit):
    assert batch_fault({"labels": torch.full((1, 8), -100)}, culprit) is None

"""Slow end to end: the bundled failing training runs (samples/), recorded, then replayed.

Each sample trains a real model for tens of steps with the recorder on until it fails; the replay of
its first snapshot must give the verdict the sample's docstring argues for.
"""
from __future__ import annotations

import importlib
import json

import pytest

from analyzer.replay import replay_snapshot
from samples._common import snapshots_of

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sample, verdict, op, module", [
    # q @ k^T unscaled: the matmul overflows FP16 in the first block's attention
    ("fp16_attention_overflow", "overflow", "aten.bmm", "blocks.0.attn"),
    # (x - mean) / std without eps over a constant feature: 0/0 in FP32 as well
    ("bf16_nan", "numerical_bug", "aten.div", "norm"),
    # a padded query row fully masked with -inf: softmax of it is NaN in any precision
    ("masked_padding", "numerical_bug", "aten._softmax", "blocks.0.attn"),
    # a torch.library softplus that autocast feeds FP16
    ("custom_op_outside_autocast", "unregistered_op", "samples.softplus", "features.4"),
    # log of a probability that is exactly 0
    ("log_zero", "numerical_bug", "aten.log", "<loss_fn>"),
])
def test_the_first_snapshot_of_a_failing_sample_replays_to_its_documented_verdict(tmp_path, sample, verdict, op,
                                                                                   module):
    run_dir = importlib.import_module(f"samples.{sample}").run(tmp_path / sample)
    first = snapshots_of(run_dir)[0]
    r = replay_snapshot(first)
    assert (r.verdict, r.culprit["op"], r.culprit["module"]) == (verdict, op, module)
    json.dumps(r.to_dict(), allow_nan=False)


def test_the_healthy_sample_replays_as_healthy(tmp_path):
    run_dir = importlib.import_module("samples.healthy").run(tmp_path / "healthy")
    r = replay_snapshot(snapshots_of(run_dir)[-1], dtypes=["bf16"])
    assert r.verdict == "healthy" and all(run["finite"] for run in r.runs.values())

"""Slow end to end: the bundled failing training runs (samples/), recorded, then replayed.

Each sample trains a real model for tens of steps with the recorder on until it fails; the replay of
its first snapshot must give the verdict the sample's docstring argues for, on the step the sample
pins. The runs are shared with tests/test_samples.py (``tests.sample_runs``): each trains once.
"""
from __future__ import annotations

import json

import pytest

from analyzer.replay import replay_snapshot
from samples._common import snapshots_of
from tests.sample_runs import sample_run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sample, step, verdict, op, module", [
    # q @ k^T unscaled, then the temperature jump: the matmul overflows FP16 in the first block's attention
    ("fp16_attention_overflow", 24, "overflow", "aten.bmm", "blocks.0.attn"),
    # (x - mean) / std without eps over a constant feature: 0/0 in FP32 as well
    ("bf16_nan", 12, "numerical_bug", "aten.div", "norm"),
    # a padded query row fully masked with -inf: softmax of it is NaN in any precision
    ("masked_padding", 15, "numerical_bug", "aten._softmax", "blocks.0.attn"),
    # a torch.library softplus that autocast feeds FP16
    ("custom_op_outside_autocast", 28, "unregistered_op", "samples.softplus", "features.4"),
    # log of a probability that is exactly 0
    ("log_zero", 20, "numerical_bug", "aten.log", "<loss_fn>"),
])
def test_the_first_snapshot_of_a_failing_sample_replays_to_its_documented_verdict(tmp_path_factory, sample, step,
                                                                                   verdict, op, module):
    first = snapshots_of(sample_run(tmp_path_factory, sample))[0]
    assert first.name.startswith(f"step{step:08d}-")
    r = replay_snapshot(first)
    assert (r.verdict, r.culprit["op"], r.culprit["module"]) == (verdict, op, module)
    json.dumps(r.to_dict(), allow_nan=False)


def test_the_healthy_sample_replays_as_healthy(tmp_path_factory):
    run_dir = sample_run(tmp_path_factory, "healthy")
    r = replay_snapshot(snapshots_of(run_dir)[-1], dtypes=["bf16"])
    assert r.verdict == "healthy" and all(run["finite"] for run in r.runs.values())

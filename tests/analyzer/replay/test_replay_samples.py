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
from tests.sample_runs import FAILING_SAMPLES, sample_run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sample, step, verdict, op, module", FAILING_SAMPLES)
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

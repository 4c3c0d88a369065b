"""``analyzer replay --json`` on every snapshot of every sample scenario prints its golden JSON.

See ``golden_json.py`` for what is masked and how the golden files are written.
"""
from __future__ import annotations

import pytest

from samples._common import snapshots_of
from tests.analyzer.replay.golden_json import check_golden, cli_json, masked
from tests.sample_runs import FAILING_SAMPLES, sample_run

pytestmark = pytest.mark.slow

SAMPLES = [s[0] for s in FAILING_SAMPLES] + ["stalled_layers", "loss_outside_autocast", "healthy"]


@pytest.mark.parametrize("sample", SAMPLES)
def test_replay_json_of_each_sample_snapshot_matches_its_golden_file(tmp_path_factory, sample):
    run_dir = sample_run(tmp_path_factory, sample)
    snaps = snapshots_of(run_dir)
    got = {s.name: masked(cli_json("replay", str(s), "--device", "cpu"), [str(run_dir)]) for s in snaps}
    check_golden(f"replay-{sample}", got)

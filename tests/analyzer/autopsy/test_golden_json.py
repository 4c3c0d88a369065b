"""``analyzer autopsy --json`` on every sample scenario prints its golden JSON.

See ``tests/analyzer/replay/golden_json.py`` for what is masked and how the golden files are written.
"""
from __future__ import annotations

import pytest

from tests.analyzer.replay.golden_json import check_golden, cli_json, masked
from tests.analyzer.replay.test_golden_json import SAMPLES
from tests.sample_runs import sample_run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sample", SAMPLES)
def test_autopsy_json_of_each_sample_matches_its_golden_file(tmp_path_factory, sample):
    run_dir = sample_run(tmp_path_factory, sample)
    got = masked(cli_json("autopsy", str(run_dir), "--device", "cpu"), [str(run_dir)])
    check_golden(f"autopsy-{sample}", got)

"""An FP8-born NaN (``nan_models``): the recorder's nonfinite_loss snapshot replays finite in FP32 and BF16 and
non-finite in FP8; the answer names the op that made the NaN, its module, and the cast that flushed its input."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from analyzer.cli import main
from tests.extras import require

from . import nan_models as nm

require("torchao.float8", "fp8")


def _json(*args: str) -> dict:
    res = CliRunner().invoke(main, [*args, "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("nan") / "run"
    return run, nm.train(run)


def test_replay_names_the_division_in_normalize_and_the_cast_that_flushed_the_quiet_row(nan_run):
    _, snaps = nan_run
    assert [p.name.endswith("-nonfinite_loss.pt") for p in snaps] == [True]
    r = _json("replay", str(snaps[0]))
    assert r["verdict"] == "fp8_nonfinite"
    assert r["runs"]["float32"]["finite"] and r["runs"]["bfloat16"]["finite"]
    at = r["fp8"]["nonfinite_at"]
    assert (at["op"], at["module"], at["phase"]) == ("aten.div", "normalize", "forward")
    cast = at["cast"]
    assert (cast["module"], cast["role"], cast["phase"], cast["use"]) == ("proj", "input", "forward", "forward")
    # at least the quiet token's whole row (DIM values of 1e-3) is flushed, under the scale the loud token set
    assert cast["flushed"] >= nm.DIM and cast["amax"] == pytest.approx(nm.LOUD_VALUE, rel=1e-2)
    assert 0 < cast["flushed_frac"] < 0.5  # too few to be fp8_underflow: the NaN, not the count, broke the step
    assert cast["outlier"]["column"] == 0


def test_autopsy_verifies_rowwise_and_keeping_proj_in_bf16_against_bf16(nan_run):
    run, _ = nan_run
    a = _json("autopsy", str(run))
    assert a["verdict"] == "fp8_nonfinite"
    fixes = {f["name"]: f for f in a["fixes"]}
    assert fixes["fp8_rowwise"]["status"] == "verified"
    assert fixes["fp8_keep_bf16"]["status"] == "verified" and "{'proj'}" in fixes["fp8_keep_bf16"]["title"]
    for name in ("fp8_rowwise", "fp8_keep_bf16"):
        assert "the unchanged FP8 step fails the same test" in fixes[name]["detail"]

"""Issue #44's denoiser with the Recorder, then without it (the README's "After a crash" snippet): the same answer.

With the recorder, the answer names the reciprocal with its smallest input, the cast that made σ FP16 and a
verified fix keeping that region in FP32; without it, a checkpoint and the batch saved with its RNG state replay
to the same verdict, op and line (``denoiser_models``: FP16 autocast, ``GradScaler("cpu")`` at its default
init_scale, a loss that draws σ itself).
"""
from __future__ import annotations

import inspect
import json

import pytest
from click.testing import CliRunner

from analyzer.cli import main

from . import denoiser_models as dm


def _line(code: str) -> str:
    lines, first = inspect.getsourcelines(dm.denoiser_loss)
    return f"tests/analyzer/replay/denoiser_models.py:{first + next(i for i, t in enumerate(lines) if code in t)}"


def _json(*args: str) -> dict:
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    snap = dm.train_recorded(tmp_path_factory.mktemp("recorded") / "run")
    return snap, _json("autopsy", str(snap.parent.parent))


def test_with_the_recorder_the_answer_names_the_reciprocal_its_smallest_input_the_cast_and_a_verified_region(recorded):
    _snap, out = recorded
    c, weight, cast = out["culprit"], _line("weight = 1 / sigma ** 2"), _line("sigma = sigma.to(pred.dtype)")
    assert out["verdict"] == "overflow" and (c["op"], c["module"], c["source"]) == ("aten.reciprocal", "<loss_fn>", weight)
    [replay] = out["replays"]
    small = replay["small_input"]
    assert 0 < small["smallest_nonzero_abs"] < 1 / 65504  # 1/x passes FP16's max exactly there
    assert (small["cast"]["source"], small["cast"]["input_dtypes"], small["cast"]["output_dtype"]) == (
        cast, ["float32"], "float16")
    [region] = [f for f in out["fixes"] if f["name"] == "region_fp32"]
    assert region["status"] == "verified" and cast in region["title"] and weight in region["title"]
    head = out["answer"][0]
    assert "smallest non-zero |x|" in head and cast in head
    assert not any("learning rate" in a["text"] for a in out["advice"])  # σ is a random draw, not the weights


def test_without_the_recorder_the_readme_snippets_files_replay_to_the_same_verdict_op_and_line(recorded, tmp_path):
    snap, out = recorded
    crashed = dm.train_until_nonfinite(tmp_path, save_rng="batch")  # the same loop, seeds and failing step
    assert f"step{crashed['step']:08d}" in snap.name
    plain = _json("replay", str(crashed["checkpoint"]), "--batch", str(crashed["batch"]), "--factory",
                  f"{dm.REF}:build_denoiser", "--loss-fn", f"{dm.REF}:denoiser_loss")
    c = out["culprit"]
    assert (plain["verdict"], plain["culprit"]["op"], plain["culprit"]["source"]) == (out["verdict"], c["op"], c["source"])

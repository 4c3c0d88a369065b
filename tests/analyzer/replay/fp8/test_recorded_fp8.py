"""From training to the answer with nothing written by hand: the recorder's own ``fp8`` trigger snapshots the
aligned SwiGLU's tensorwise FP8 step, and ``autopsy`` of the run directory names the cast from that snapshot."""
from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from analyzer.cli import main
from tests.extras import require

from . import swiglu_models as sm

require("torchao.float8", "fp8")


def _train(run_dir, recipe: str, steps: int = 3):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from recorders import Recorder

    model = sm.build(True)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # the loop as a user writes it: the factory rebuilds the plain model, the recorder records the recipe
    with Recorder(run_dir, model, factory=f"{sm.REF}:build", factory_kwargs={"aligned": True},
                  loss_fn=f"{sm.REF}:lm_loss", amp_dtype=torch.bfloat16, optimizer=opt) as rec:
        for step in range(steps):
            b = sm.batch(step)
            rec.begin_step(step, b)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = sm.lm_loss(model, b)
            loss.backward()
            assert rec.end_step(loss) is None  # an fp8 snapshot is no training failure
            opt.step()
            opt.zero_grad()
    return rec.snapshots


def test_the_recorders_fp8_snapshot_autopsies_to_fp8_underflow_at_w2s_input(tmp_path):
    snaps = _train(tmp_path / "run", "tensorwise")
    assert [p.name.endswith("-fp8.pt") for p in snaps] == [True]  # the trigger's, at the first measured step
    res = CliRunner().invoke(main, ["autopsy", str(tmp_path / "run"), "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    a = json.loads(res.stdout)
    assert a["verdict"] == "fp8_underflow"
    first = a["replays"][0]["fp8"]["first"]
    assert (first["module"], first["role"], first["phase"]) == ("block.mlp.w2", "input", "forward")
    assert first["flushed"] / first["nonzero"] > 0.5
    assert {f["name"]: f["status"] for f in a["fixes"]}["fp8_rowwise"] == "verified"


def test_the_same_run_under_rowwise_scaling_writes_no_snapshot(tmp_path):
    assert _train(tmp_path / "run", "rowwise") == []

"""An op that raises only in low precision is the culprit (verdict ``overflow``), not an error in the model code."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main
from recorders import Recorder

from . import raise_models as rmod


@pytest.fixture(scope="module")
def exception_snapshot(tmp_path_factory):
    """FP16 with GradScaler at its default init_scale; the first step's forward raises: kept as `exception`."""
    run = tmp_path_factory.mktemp("raise") / "run"
    model = rmod.build()
    scaler, opt = torch.amp.GradScaler("cpu"), torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError, match="without overflow"):
        with Recorder(run, model, factory=f"{rmod.REF}:build", loss_fn=f"{rmod.REF}:loss_fn", scaler=scaler,
                      amp_dtype=torch.float16, optimizer=opt) as rec:
            for step in range(3):
                b = rmod.batch(step)
                rec.begin_step(step, b)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = rmod.loss_fn(model, b)
                scaler.scale(loss).backward()
                rec.end_step(loss)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    [snap] = rec.snapshots
    assert snap.name == "step00000000-r00000-exception.pt"  # the step-0 failure, kept by __exit__
    return snap


def test_the_fp16_op_that_raised_is_an_overflow_culprit_with_the_value_and_the_range(exception_snapshot):
    res = CliRunner().invoke(main, ["replay", str(exception_snapshot), "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    c = out["culprit"]
    assert out["verdict"] == "overflow"
    assert (c["op"], c["module"], c["phase"], c["precision"]) == ("aten.masked_fill", "attn", "forward", "float16")
    line = next(i for i, t in enumerate(open(rmod.__file__), 1) if "masked_fill(pad" in t)
    assert c["source"] == f"tests/analyzer/replay/raise_models.py:{line}" and c["output_kind"] == "raised"
    assert c["raised"]["values"] == [-1e9] and c["raised"]["dtype_max"] == 65504.0
    assert "without overflow" in c["raised"]["error"]
    assert out["runs"]["float32"]["finite"] is True and out["runs"]["float16"]["finite"] is False


def test_the_text_says_what_was_given_and_the_fix_names_finfo(exception_snapshot):
    res = CliRunner().invoke(main, ["replay", str(exception_snapshot), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "verdict: overflow" in res.output
    assert "was given -1e+09, beyond float16's max 65504, and raised RuntimeError" in res.output
    assert "The FP32 run of the step is finite." in res.output
    assert "torch.finfo(x.dtype).min instead of -1e+09" in res.output
    # the value beyond the range is the constant, not an activation training grew: no learning-rate advice
    assert "learning rate" not in res.output


def test_autopsy_names_the_same_op_and_exits_0(exception_snapshot):
    res = CliRunner().invoke(main, ["autopsy", str(exception_snapshot.parent.parent), "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["verdict"] == "overflow" and out["culprit"]["op"] == "aten.masked_fill"
    # BF16 holds -1e9: switching is tried on the step and judged against FP32
    bf16 = [f for f in out["fixes"] if f["name"] == "bf16"]
    assert bf16 and bf16[0]["status"] == "verified", out["fixes"]


def test_an_op_that_raises_in_fp32_too_stays_one_error_line(tmp_path):
    # a mask of the wrong shape raises in every precision: the model code's error, not a culprit
    torch.save(rmod.build().state_dict(), tmp_path / "m.pt")
    b = rmod.batch()
    b["pad"] = torch.zeros(2, 5, dtype=torch.bool)
    torch.save(b, tmp_path / "b.pt")
    res = CliRunner().invoke(main, ["replay", str(tmp_path / "m.pt"), "--batch", str(tmp_path / "b.pt"),
                                    "--factory", f"{rmod.REF}:build", "--loss-fn", f"{rmod.REF}:loss_fn"])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: ") and "raised RuntimeError" in lines[0]

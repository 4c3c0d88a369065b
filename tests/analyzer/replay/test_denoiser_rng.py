"""A failure that lives in a random draw, replayed without a recorder: the denoiser whose loss draws σ itself
(``denoiser_models``) trained in FP16 until its loss is inf, then ``replay``/``autopsy CHECKPOINT --batch``
with the RNG state the README's snippet saves (beside the batch, or ``--rng FILE``): the failing draw again."""
from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main
from tests.analyzer.replay import denoiser_models as dm

REFS = ["--factory", f"{dm.REF}:build_denoiser", "--loss-fn", f"{dm.REF}:denoiser_loss"]


def _weight_line() -> str:
    """``denoiser_models.py:N``, N the line of ``weight = 1 / sigma ** 2`` (where the reciprocal runs)."""
    lines, first = inspect.getsourcelines(dm.denoiser_loss)
    n = next(i for i, text in enumerate(lines) if "weight = 1 / sigma ** 2" in text)
    return f"tests/analyzer/replay/denoiser_models.py:{first + n}"


@pytest.fixture(scope="module", params=["batch", "file"])
def crashed(request, tmp_path_factory):
    return dm.train_until_nonfinite(tmp_path_factory.mktemp(f"denoiser_{request.param}"), save_rng=request.param)


def _args(crashed) -> list[str]:
    rng = ["--rng", str(crashed["rng"])] if crashed["rng"] is not None else []
    return [str(crashed["checkpoint"]), "--batch", str(crashed["batch"]), *rng, *REFS]


def test_the_run_fails_at_a_draw_of_sigma_below_fp16s_reach(crashed):
    assert crashed["loss"] == float("inf") and crashed["step"] > 0  # trained a while, then drew a small σ


def test_replay_with_the_saved_rng_state_reproduces_the_failing_draw(crashed):
    res = CliRunner().invoke(main, ["replay", *_args(crashed), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["verdict"] == "overflow" and out["culprit"]["op"] == "aten.reciprocal"
    assert out["culprit"]["module"] == "<loss_fn>" and out["culprit"]["phase"] == "forward"
    assert out["culprit"]["source"] == _weight_line()
    assert out["runs"]["float32"]["finite"] is True and out["runs"]["float16"]["finite"] is False
    assert out["checkpoint"]["seed"] is None and out["checkpoint"]["rng"] == str(crashed["rng"] or crashed["batch"])


def test_autopsy_with_the_saved_rng_state_names_the_same_op_and_line(crashed):
    res = CliRunner().invoke(main, ["autopsy", *_args(crashed), "--json"])
    assert res.exit_code == 0, res.output
    [replay] = json.loads(res.output)["replays"]
    assert (replay["verdict"], replay["culprit"]["op"], replay["culprit"]["source"]) == \
        ("overflow", "aten.reciprocal", _weight_line())


def _readme_snippet() -> str:
    """The python block of README.md's "After a crash" section."""
    text = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = text.split("## After a crash", 1)[1].split("\n## ", 1)[0]
    return textwrap.dedent(section.split("```python\n", 1)[1].split("```", 1)[0])


def test_the_readmes_after_a_crash_snippet_saves_what_replay_reads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = compile(_readme_snippet(), "README.md", "exec")
    torch.manual_seed(0)
    model, scaler = dm.build_denoiser(), torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(400):
        scope = {"torch": torch, "model": model, "batch": dm.make_batch(step), "loss_fn": dm.denoiser_loss}
        with torch.autocast("cpu", dtype=torch.float16):
            exec(code, scope)  # noqa: S102 - the README's own lines, as a user pastes them into the loop
        if not torch.isfinite(scope["loss"]):
            torch.save(model.state_dict(), "ckpt.pt")
            break
        scaler.scale(scope["loss"]).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    res = CliRunner().invoke(main, ["replay", "ckpt.pt", "--batch", "batch.pt", *REFS, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert (out["verdict"], out["culprit"]["op"]) == ("overflow", "aten.reciprocal")
    assert out["culprit"]["source"].endswith(_weight_line())  # absolute: replayed from another directory

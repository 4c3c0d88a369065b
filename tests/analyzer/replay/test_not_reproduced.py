"""``not_reproduced``: a replay that did not replay the failing step says so instead of ``healthy``.

Two real cases: a transient fault (a hook in the training loop, not in the model, writes a NaN into
one forward only, so the recorder sees a NaN loss that the replay cannot make), and a step whose loss
draws its own noise level, replayed from a checkpoint and batch saved without the RNG state.
"""
from __future__ import annotations

import inspect
import json
import math

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main
from analyzer.replay import replay_snapshot
from analyzer.replay.probes.reproduction import RNG_OPS
from recorders import Recorder

from . import denoiser_models as dm
from . import replay_models as rm

FAULT_STEP = 4


def _train_with_a_transient_fault(run_dir, amp_dtype):
    """A healthy MLP whose output is NaN at FAULT_STEP's forward alone (a one-call hook in the loop)."""
    model = rm.build_mlp()
    calls = {"n": 0}

    def flip(_mod, _args, out):  # what a bad memory page or a flipped bit does once
        calls["n"] += 1
        return out.clone().fill_(float("nan")) if calls["n"] == FAULT_STEP + 1 else None

    model[0].register_forward_hook(flip)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with Recorder(run_dir, model, factory=f"{rm.REF}:build_mlp", loss_fn=f"{rm.REF}:mse", amp_dtype=amp_dtype,
                  optimizer=opt) as rec:
        for step in range(FAULT_STEP + 2):
            batch = {"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 1, generator=g)}
            rec.begin_step(step, batch)
            with torch.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = rm.mse(model, batch)
            loss.backward()
            if rec.end_step(loss) is None:
                opt.step()
            opt.zero_grad()
    [snap] = [p for p in rec.snapshots if p.name.startswith(f"step{FAULT_STEP:08d}")]
    return snap


@pytest.fixture(scope="module", params=[None, torch.bfloat16], ids=["fp32", "bf16"])
def transient(request, tmp_path_factory):
    return _train_with_a_transient_fault(tmp_path_factory.mktemp("transient") / "run", request.param)


def test_a_nan_that_a_replay_with_the_recorded_rng_cannot_make_is_not_reproduced(transient):
    r = replay_snapshot(transient, device="cpu")
    assert r.verdict == "not_reproduced" and r.culprit is None
    assert math.isnan(r.recorded_loss) and all(run.finite for run in r.runs.values())
    ev = r.to_dict()["not_reproduced"]
    assert ev["recorded"] == "a NaN/Inf loss" and ev["recorded_loss"] == "nan"
    assert set(ev["replayed_loss"]) == set(r.runs) and all(math.isfinite(v) for v in ev["replayed_loss"].values())
    # the summary shows both losses and what a finite replay of a recorded NaN means
    assert "loss nan" in r.summary and "did not reproduce" in r.summary and "transient hardware fault" in r.summary
    assert str(round(ev["replayed_loss"]["float32"], 4))[:5] in r.summary
    assert any("--device" in a for a in r.advice) and any("analyzer report" in a for a in r.advice)


def test_autopsy_says_not_reproduced_and_tries_no_fix(transient):
    res = CliRunner().invoke(main, ["autopsy", str(transient.parent.parent), "--json", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["verdict"] == "not_reproduced" and out["culprit"] is None and out["fixes"] == []
    [replay] = [x for x in out["replays"] if x["step"] == FAULT_STEP]
    assert replay["verdict"] == "not_reproduced" and replay["not_reproduced"]["recorded_loss"] == "nan"
    assert out["answer"][0].startswith("root cause: not_reproduced: The recorder saw this step fail")


def test_a_replayed_failure_stays_what_it_was_with_a_recorded_rng(tmp_path):
    # the denoiser with its RNG state saved: the failing draw again, no reproduction evidence
    crashed = dm.train_until_nonfinite(tmp_path, save_rng="batch")
    res = CliRunner().invoke(main, ["replay", str(crashed["checkpoint"]), "--batch", str(crashed["batch"]),
                                    "--factory", f"{dm.REF}:build_denoiser", "--loss-fn",
                                    f"{dm.REF}:denoiser_loss", "--json"])
    out = json.loads(res.output)
    assert out["verdict"] == "overflow" and "random_draws" not in out and "not_reproduced" not in out


def _sigma_line() -> str:
    lines, first = inspect.getsourcelines(dm.denoiser_loss)
    n = next(i for i, text in enumerate(lines) if "torch.randn(x.shape[0]" in text)
    return f"tests/analyzer/replay/denoiser_models.py:{first + n}"


def test_a_step_that_draws_without_its_rng_state_is_not_healthy_and_names_the_draw(tmp_path):
    crashed = dm.train_until_nonfinite(tmp_path, save_rng="none")
    args = [str(crashed["checkpoint"]), "--batch", str(crashed["batch"]), "--factory",
            f"{dm.REF}:build_denoiser", "--loss-fn", f"{dm.REF}:denoiser_loss"]
    out = json.loads(CliRunner().invoke(main, ["replay", *args, "--json"]).output)
    # the fixed seed drew a σ that FP16 holds: every precision finite, which is not the failing step
    assert out["verdict"] == "not_reproduced" and out["checkpoint"]["seed"] == 0
    draws = out["random_draws"]
    first = draws["draws"][0]
    assert first["op"].removeprefix("aten.") in RNG_OPS and first["module"] == "<loss_fn>"
    assert first["source"] == _sigma_line() and first["phase"] == "forward"
    text = CliRunner().invoke(main, ["replay", *args]).output
    assert "verdict: not_reproduced" in text and "no RNG state was given" in text and _sigma_line() in text
    assert "--rng FILE" in text and "verdict: healthy" not in text

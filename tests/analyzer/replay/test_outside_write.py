"""A NaN written into a weight between optimizer steps is not blamed on the optimizer.

A real loop (FP16 autocast, GradScaler at its default init_scale, Adam) trains a few steps, then
writes NaN into one weight in place between two steps, as a bad checkpoint load or a stray
``param.data[...] = ...`` does. The Recorder snapshots the next step; its weights are NaN beside a
finite Adam state, so the update forensics look at it first: the recomputed update there is
finite and tiny, which cannot make a weight NaN, so the answer is ``nonfinite_input`` naming the
parameter, with the note that the weight was written outside the optimizer step.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from analyzer.load import load_snapshot
from analyzer.render import render_replay_text
from analyzer.replay import replay_snapshot
from analyzer.replay.update.forensics import OUTSIDE_NOTE, _classify, update_applies, update_forensics
from recorders import Recorder

REF = "tests.analyzer.replay.test_outside_write"
POISON_STEP = 4   # the weight is written NaN right before this step
POISONED = "0.weight"


def build_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def mse(model: nn.Module, batch: dict) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])


def _train(run_dir: Path, **recorder_kwargs) -> list[Path]:
    model = build_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")  # default init_scale 65536
    g = torch.Generator().manual_seed(1)
    with Recorder(run_dir, model, factory=f"{REF}:build_mlp", loss_fn=f"{REF}:mse", optimizer=opt, scaler=scaler,
                  amp_dtype=torch.float16, **recorder_kwargs) as rec:
        for step in range(POISON_STEP + 2):
            if step == POISON_STEP:
                with torch.no_grad():
                    model[0].weight[2, 1] = float("nan")  # an in-place write outside the optimizer
            batch = {"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 1, generator=g)}
            rec.begin_step(step, batch)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = mse(model, batch)
            scaler.scale(loss).backward()
            rec.end_step(loss)
            scaler.step(opt)
            scaler.update()
        return list(rec.snapshots)


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory) -> list[Path]:
    return _train(tmp_path_factory.mktemp("outside") / "run")


def test_the_snapshot_after_the_write_holds_the_nan_weight_beside_a_finite_adam_state(poisoned):
    snap = load_snapshot(poisoned[0])
    assert snap.step == POISON_STEP
    assert not bool(torch.isfinite(snap.model_state[POISONED]).all())
    assert update_applies(snap)  # so the update forensics are asked first
    p, = update_forensics(str(poisoned[0]), snap)["params"]
    # the recomputed Adam update at the NaN element is finite and far below half an ulp of FP32's max
    assert p["name"] == POISONED and p["factors"] == {"unexplained": 1}
    assert all(math.isfinite(ex["update"]) and abs(ex["update"]) < 1.0 for ex in p["examples"])
    assert all(math.isfinite(v) for ex in p["examples"] for k, v in ex.items() if k in ("exp_avg", "exp_avg_sq"))


def test_a_weight_written_nan_between_steps_is_a_nonfinite_input_naming_it_with_no_optimizer_verdict(poisoned):
    r = replay_snapshot(poisoned[0])
    assert r.verdict == "nonfinite_input"
    assert r.nonfinite_inputs == [f"param:{POISONED}"]
    assert r.culprit["phase"] != "optimizer" and r.culprit["input"] == f"param:{POISONED}"
    assert r.update is None and r.runs  # the forward and backward were replayed, not the update
    assert f"NB: {POISONED}: {OUTSIDE_NOTE}." in r.summary
    assert "optimizer update" not in r.summary and "overflow" not in r.summary


# the gap below each dtype's max: 2^(exponent of max - mantissa bits): 65504 - 65472, 2^(127-7), 2^(127-23)
@pytest.mark.parametrize("dtype, gap", [(torch.float16, 32.0), (torch.bfloat16, 2.0**120), (torch.float32, 2.0**104)])
def test_weight_overflow_needs_an_inf_weight_and_an_update_of_half_the_gap_below_the_max(dtype, gap):
    # finite w <= max plus finite u rounds to inf only when |u| >= gap / 2, and is never NaN
    top = torch.tensor(torch.finfo(dtype).max, dtype=dtype)
    assert float(top) - gap == float(torch.tensor(float(top) - gap, dtype=dtype))  # the next value below the max
    post = torch.tensor([float("inf"), float("inf"), float("nan"), 1.0], dtype=dtype)
    upd = torch.tensor([gap / 2, gap / 4, gap * 8, 0.0], dtype=dtype)
    masks = _classify(post, None, upd, {}, None)
    assert masks["weight_overflow"].tolist() == [True, False, False, False]
    assert masks["unexplained"].tolist() == [False, True, True, False]
    assert torch.isinf(top + upd[0]) and torch.isfinite(top + upd[1])  # the rule is the dtype's own rounding


# -- an update snapshot: a NaN written into an embedding row the batch never looks up -----------------
def build_emb() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 4), nn.Linear(4, 1))


def emb_mse(model: nn.Module, batch: dict) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch["tok"]).squeeze(-1), batch["y"])


def test_an_update_snapshot_whose_nan_no_update_explains_is_a_nonfinite_input_without_optimizer_culprit(tmp_path):
    model = build_emb()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    with Recorder(tmp_path / "run", model, factory=f"{REF}:build_emb", loss_fn=f"{REF}:emb_mse", optimizer=opt,
                  check_update=True) as rec:
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model[0].weight[12, 0] = float("nan")  # row 12: never looked up, so its loss and grads stay finite
            batch = {"tok": torch.randint(0, 8, (8, 3), generator=g), "y": torch.randn(8, 3, generator=g)}
            rec.begin_step(step, batch)
            opt.zero_grad(set_to_none=True)
            loss = emb_mse(model, batch)
            loss.backward()
            rec.end_step(loss)
            opt.step()
        snaps = list(rec.snapshots)
    update = [s for s in snaps if s.name.endswith("-update.pt")]
    assert update, snaps
    r = replay_snapshot(update[0])
    assert r.verdict == "nonfinite_input" and r.culprit is None and r.nonfinite_inputs == ["param:0.weight"]
    p = r.update["params"][0]
    assert p["factors"] == {"unexplained": 1}
    # the evidence of the note: Adam's state at the NaN element is finite (and 0: the row never had a gradient)
    assert [(ex["exp_avg"], ex["exp_avg_sq"], ex["update"]) for ex in p["examples"]] == [(0.0, 0.0, 0.0)]
    assert len(r.advice) == 1 and r.advice[0].startswith("find what wrote this weight between optimizer steps")
    assert OUTSIDE_NOTE in r.summary and "`0.weight`" in r.summary
    assert "optimizer update of step" not in r.summary
    assert "update forensics" in render_replay_text(r) and json.dumps(r.to_dict(), allow_nan=False)

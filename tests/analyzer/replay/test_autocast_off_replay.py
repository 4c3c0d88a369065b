"""A run whose autocast never switched on (``torch.autocast("cuda")`` around a CPU model) replays as the FP32 run it was.

The recorder was told ``amp_dtype=float16``, and the snapshot says so; the recorder also saw autocast
off during the first training forward (meta.json's ``autocast``). The model's activations pass
FP16's max (a Linear whose outputs are ~1e5), so an FP16 replay would name an overflow that never
happened in training: the replay must run the step in FP32, as it ran, and say why.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from analyzer.replay import replay_snapshot
from recorders import Recorder

REF = "tests.analyzer.replay.test_autocast_off_replay"


def build_big() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    with torch.no_grad():
        m[0].weight.fill_(1e4)  # inputs of ~10 make outputs ~1e5: past FP16's 65504, fine in FP32
        m[0].bias.zero_()
    return m


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)


def _record(tmp_path, device_type: str):
    model = build_big()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the weights stay as built
    batch = (torch.full((4, 8), 10.0), torch.zeros(4, 1))
    run = tmp_path / f"run-{device_type}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own autocast("cuda") warning, and the recorder's
        with Recorder(run, model, factory=f"{REF}:build_big", loss_fn=f"{REF}:loss_fn",
                      amp_dtype=torch.float16, optimizer=opt) as rec:
            for step in range(2):
                rec.begin_step(step, batch)
                with torch.autocast(device_type, dtype=torch.float16):
                    loss = loss_fn(model, batch)
                loss.backward()
                if step == 0:
                    rec.snapshot()
                rec.end_step(loss)
                opt.step()
                opt.zero_grad()
    (snap,) = sorted((run / "snapshots").glob("*-manual.pt"))
    return str(snap)


def test_a_run_whose_autocast_was_off_replays_in_fp32_as_it_ran_and_says_why(tmp_path):
    r = replay_snapshot(_record(tmp_path, "cuda"))  # autocast("cuda") around a CPU model: disabled
    assert r.verdict == "healthy" and r.culprit is None
    assert set(r.runs) == {"float32"}  # no FP16 run: training never computed in FP16
    assert "amp_dtype=float16" in r.summary and "autocast off on cpu" in r.summary
    assert "replayed as it ran, in FP32" in r.summary


def test_the_same_model_under_cpu_autocast_replays_its_fp16_overflow(tmp_path):
    # the counter-check: with autocast really on, the same step overflows FP16, and the replay says so
    r = replay_snapshot(_record(tmp_path, "cpu"))
    assert "float16" in r.runs and not r.runs["float16"]["finite"]
    assert r.verdict == "overflow" and "autocast off" not in r.summary

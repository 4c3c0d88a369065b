"""Gradient accumulation in a plain loop: ``rec.begin_step(step, [mb0, mb1, ...])`` with a per-micro-batch
loss function. The snapshot keeps every micro-batch, the replay re-runs them all with each loss divided
by their number (as the loop's ``loss / N`` did) and names the micro-batch (0-based) the failure is in."""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from recorders import Recorder, schema
from tests.analyzer.replay import replay_models as rm

MICRO, ROWS, STEPS, BAD_STEP, BAD_MICRO = 4, 4, 4, 2, 2


def _micro_batches(step: int, *, nan: bool = False, big: bool = False) -> list[dict]:
    g = torch.Generator().manual_seed(100 + step)
    mbs = [{"x": torch.randn(ROWS, 4, generator=g), "y": torch.randn(ROWS, 1, generator=g)} for _ in range(MICRO)]
    if nan and step == BAD_STEP:
        mbs[BAD_MICRO]["x"][1, 2] = float("nan")  # the third micro-batch of step 2 only
    return mbs


def _train(run_dir: Path, *, amp_dtype=torch.float16, nan: bool = True, manual_at: int | None = None) -> dict:
    """The loop as people write it: GradScaler at its default init_scale, ``loss / N`` per micro-batch."""
    model = rm.build_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu") if amp_dtype is torch.float16 else None
    rec = Recorder(run_dir, model, factory=f"{rm.REF}:build_mlp", loss_fn=f"{rm.REF}:mse", scaler=scaler,
                   amp_dtype=amp_dtype, optimizer=opt, micro_batches=MICRO)
    grads = None
    with rec:
        for step in range(STEPS):
            mbs = _micro_batches(step, nan=nan)
            rec.begin_step(step, mbs)
            total = 0.0
            for mb in mbs:
                with torch.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss = rm.mse(model, mb) / MICRO
                (scaler.scale(loss) if scaler else loss).backward()
                total = total + loss.detach()
            rec.end_step(total)
            if step == manual_at:
                rec.snapshot()
                grads = [p.grad.clone() for p in model.parameters()]
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
    return {"snapshots": list(rec.snapshots), "grads": grads, "run_dir": run_dir}


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("accum_nan") / "run")


def test_the_snapshot_holds_every_micro_batch_and_how_their_losses_were_combined(nan_run):
    [path] = [p for p in nan_run["snapshots"] if f"step{BAD_STEP:08d}" in p.name]
    snap = torch.load(path, weights_only=True)
    assert snap["format_version"] >= 6  # micro_batches: since format 6
    assert isinstance(snap["batch"], list) and len(snap["batch"]) == MICRO
    assert torch.isnan(snap["batch"][BAD_MICRO]["x"]).any() and not torch.isnan(snap["batch"][0]["x"]).any()
    assert snap["micro_batches"] == {"count": MICRO, "combine": "mean", "divisor": float(MICRO), "source": "list",
                                     "num_items_in_batch": None}
    meta = json.loads((nan_run["run_dir"] / schema.META_FILE).read_text())
    assert meta["micro_batches_kept"] is True


def test_replay_names_the_nan_input_in_micro_batch_2(nan_run):
    from analyzer.render import render_replay_text
    from analyzer.replay import replay_snapshot

    [path] = [p for p in nan_run["snapshots"] if f"step{BAD_STEP:08d}" in p.name]
    r = replay_snapshot(path, device="cpu")
    assert r.verdict == "nonfinite_input"
    assert r.nonfinite_inputs == [f"batch:{BAD_MICRO}.x"]
    assert r.culprit["micro_batch"] == BAD_MICRO
    assert f"micro-batch {BAD_MICRO} (0-based)" in r.summary
    out = r.to_dict()
    assert out["culprit"]["micro_batch"] == BAD_MICRO and out["micro_batches"]["count"] == MICRO
    json.dumps(out, allow_nan=False)
    text = render_replay_text(r)
    assert f"micro-batch {BAD_MICRO} of {MICRO} (0-based)" in text
    assert f"accumulated {MICRO} micro-batches" in text


@pytest.mark.slow
def test_the_autopsy_heads_its_answer_with_the_nan_input_of_micro_batch_2(nan_run):
    from analyzer.autopsy import run_autopsy
    from analyzer.autopsy.answer import answer_lines

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_autopsy(nan_run["run_dir"], device="cpu")
    lines = answer_lines(result)
    assert lines[0].startswith("root cause: nonfinite_input: ")
    assert f"batch:{BAD_MICRO}.x" in lines[0] and f"micro-batch {BAD_MICRO} (0-based)" in lines[0]
    assert not any("holds the first only" in line for line in lines)


def test_a_healthy_accumulated_step_replays_healthy_with_the_gradients_training_summed(tmp_path):
    from analyzer.replay import Replay
    from analyzer.replay.runs._runs import run_once

    run = _train(tmp_path / "run", amp_dtype=None, nan=False, manual_at=1)
    [path] = run["snapshots"]
    replay = Replay(path, device="cpu")
    r = replay.run()
    assert r.verdict == "healthy" and r.culprit is None
    ctx = replay.context()
    run_once(ctx, "float32", 1.0)
    replayed = [p.grad for p in ctx._model.parameters()]  # run_once leaves the step's gradients there
    for got, want in zip(replayed, run["grads"]):  # FP32 on both sides, same ops in the same order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # the first micro-batch alone (the replay before accumulation) gives other gradients: the check can fail
    mb0 = _micro_batches(1)[0]
    model = rm.build_mlp()
    model.load_state_dict(ctx.model_state)
    rm.mse(model, mb0).backward()
    assert not torch.allclose(next(model.parameters()).grad, run["grads"][0], rtol=1e-3)
    assert math.isclose(r.runs["float32"]["loss"], r.recorded_loss, rel_tol=1e-5)


def test_an_fp16_overflow_in_one_micro_batch_names_that_micro_batch(tmp_path):
    """Attention logits are gain^2 <x, x'>: on the diagonal about 64 * 8 = 512 for randn x (finite in FP16);
    x * 30 in the second micro-batch gives about 4.6e5 there, far past FP16's 65504, whatever the rounding."""
    from analyzer.replay import replay_snapshot

    model = rm.build_attention(gain=8.0)
    g = torch.Generator().manual_seed(0)
    mbs = [{"x": torch.randn(2, 8, 8, generator=g) * (30.0 if i == 1 else 1.0), "y": torch.randn(2, 8, 1, generator=g)}
           for i in range(3)]
    rec = Recorder(tmp_path / "run", model, factory=f"{rm.REF}:build_attention", factory_kwargs={"gain": 8.0},
                   loss_fn=f"{rm.REF}:attention_mse", amp_dtype=torch.float16)
    with rec:
        rec.begin_step(0, mbs)
        for mb in mbs:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = rm.attention_mse(model, mb) / len(mbs)
            loss.backward()
        rec.end_step(loss)
    [path] = rec.snapshots
    r = replay_snapshot(path, device="cpu")
    assert r.verdict == "overflow" and r.culprit["op"] == "aten.bmm"
    assert r.culprit["micro_batch"] == 1
    assert "micro-batch 1 (0-based) of the 3" in r.summary
    assert r.runs["float32"]["finite"]


@pytest.mark.parametrize("batch, declared, kept", [
    ([torch.ones(2), torch.ones(2)], None, False),  # [x, y]: one batch of two tensors
    ((({"x": torch.ones(2)}), {"x": torch.ones(2)}), None, False),  # a tuple is one batch
    ([{"x": torch.ones(2)}, {"x": torch.ones(2)}], 1, False),  # micro_batches=1: the list is one batch
    ([{"x": torch.ones(2)}, {"z": torch.ones(2)}], None, False),  # different structures
    ([{"x": torch.ones(2)}, {"x": torch.ones(3)}], None, True),  # sizes may differ (the last micro-batch)
    ([(torch.ones(2), torch.ones(1))] * 3, 3, True),
    ([(torch.ones(2), torch.ones(1))] * 3, 4, True),  # an epoch's last, shorter step
    ([(torch.ones(2), torch.ones(1))] * 3, 2, False),  # more than declared: not this run's micro-batches
])
def test_a_list_is_taken_for_micro_batches_only_when_its_items_share_one_structure(batch, declared, kept):
    from recorders.micro_batches import is_micro_batch_list

    assert is_micro_batch_list(batch, declared) is kept


@pytest.mark.parametrize("name, index", [
    ("batch:2.x", 2), ("batch:0.inputs_embeds", 0), ("batch:3.1", 3),
    ("param:0.weight", None),  # a module named 0 (nn.Sequential): a weight belongs to no micro-batch
    ("buffer:1.running_mean", None), ("batch:9.x", None),  # past the micro-batches the step had
])
def test_a_nonfinite_input_names_a_micro_batch_only_for_an_entry_of_the_batch_list(name, index):
    from analyzer.replay.runs._accumulate import input_micro

    assert input_micro(name, MICRO) == index

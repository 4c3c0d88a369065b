"""``analyzer replay SNAPSHOT --steps K``: the rewind window replayed in FP32 and the run's precision, on real runs."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main as cli
from recorders import Recorder
from tests.analyzer.replay.window_models import build_centered, shifted_batches, train
from tests.recorders.spike_models import build_plain, linear_batches, train_with_lr_jumps

REFS = {"factory": "tests.analyzer.replay.window_models:build_centered",
        "loss_fn": "tests.analyzer.replay.window_models:centered_loss"}


def _centered_run(d, amp_dtype, offset, **kw):
    model = build_centered()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with Recorder(d, model, **REFS, optimizer=opt, amp_dtype=amp_dtype, rewind=6, spike_window=20, **kw) as rec:
        train(model, shifted_batches(32, shift_at=30, offset=offset), opt=opt, rec=rec, amp_dtype=amp_dtype)
    return rec.snapshots


def _window(path, k, *extra):
    res = CliRunner().invoke(cli, ["replay", str(path), "--steps", str(k), "--json", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)["window"]


@pytest.fixture(scope="module")
def bf16_shift(tmp_path_factory):
    """BF16: the batch at step 30 carries an offset of 2000 that BF16 features cannot centre: a loss spike."""
    snaps = _centered_run(tmp_path_factory.mktemp("bf16"), torch.bfloat16, 2000.0)
    assert [p.name for p in snaps] == ["step00000030-r00000-loss_spike.pt"]
    return snaps[0]


def test_steps_k_names_the_step_where_bf16_parts_from_fp32_and_that_fp32_does_not_spike(bf16_shift):
    w = _window(bf16_shift, 6)
    assert [r["step"] for r in w["rows"]] == [25, 26, 27, 28, 29, 30] and w["fork_step"] == 25
    assert w["start_step"] == 24 and w["steps_held"] == 7  # starts at 0, 6, ..., 24, 30: the older one
    assert w["part_step"] == 30  # every earlier step within tolerance; the offset batch is step 30
    assert w["fp32_spikes"] is False and w["spike"]["low_spikes"] is True
    assert w["reproduction"] < 1e-6  # the BF16 replay retraces the recorded losses (same process, same kernels)
    assert any("step 24 was replayed in bfloat16 first" in n for n in w["notes"])


def test_the_text_marks_the_parting_step_and_says_the_spike_comes_from_low_precision(bf16_shift):
    res = CliRunner().invoke(cli, ["replay", str(bf16_shift), "--steps", "6"])
    assert res.exit_code == 0, res.output
    part = [line for line in res.output.splitlines() if line.endswith("<- part")]
    assert len(part) == 1 and part[0].split()[0] == "30"
    assert "FP32 from the same state does not spike at step 30" in res.output
    assert "the spike comes from low precision in these steps" in res.output


def test_more_steps_than_the_window_holds_replays_the_window_and_says_so(bf16_shift):
    w = _window(bf16_shift, 50)
    assert w["steps_asked"] == 50 and w["fork_step"] == 24 and len(w["rows"]) == 7
    assert any(n.startswith("--steps 50: the window holds 7 step(s) (from step 24") for n in w["notes"])


def test_an_lr_jump_spikes_in_fp32_too_and_the_trajectories_stay_together(tmp_path):
    model = build_plain()
    opt = torch.optim.Adam(model.parameters(), lr=0.003)
    refs = {"factory": "tests.recorders.spike_models:build_plain", "loss_fn": "tests.recorders.spike_models:plain_loss"}
    with Recorder(tmp_path, model, **refs, optimizer=opt, amp_dtype=torch.bfloat16, rewind=4, grad_spike=None) as rec:
        # the lr of step 100 is 1000x, set between end_step and opt.step: the window keeps the lr the step used
        train_with_lr_jumps(model, linear_batches(102), opt=opt, rec=rec, jumps=(100,), amp_dtype=torch.bfloat16)
    w = _window(rec.snapshots[0], 4)
    assert w["step"] == 101 and w["fp32_spikes"] is True and w["spike"]["low_spikes"] is True
    assert w["part_step"] is None and w["reproduction"] < 1e-6


def test_a_nan_snapshot_parts_at_the_step_fp16_overflows_and_fp32_stays_finite(tmp_path):
    snaps = _centered_run(tmp_path, torch.float16, 1e5)
    assert [p.name for p in snaps] == ["step00000030-r00000-nonfinite_loss.pt"]
    w = _window(snaps[0], 3)
    assert w["part_step"] == 30 and w["spike"] is None and w["fp32_spikes"] is None
    assert w["rows"][-1]["low_loss"] == "nan" and isinstance(w["rows"][-1]["fp32_loss"], float)
    res = CliRunner().invoke(cli, ["replay", str(snaps[0]), "--steps", "3"])
    assert "FP32 stays finite through step 30; float16 is NaN/Inf from step 30." in res.output


def test_a_window_with_steps_gradscaler_skipped_skips_them_in_fp16_only(tmp_path):
    model = build_centered()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")  # init_scale 65536: targets x 1e3 overflow its FP16 gradients at first
    data = shifted_batches(10)
    for b in data:
        b["y"] = b["y"] * 1e3
    with Recorder(tmp_path, model, **REFS, optimizer=opt, amp_dtype=torch.float16, scaler=scaler, rewind=8) as rec:
        train(model, data, opt=opt, rec=rec, amp_dtype=torch.float16, scaler=scaler, snapshot_at=7)
    w = _window(rec.snapshots[0], 8)
    skipped = [r["step"] for r in w["rows"] if r["recorded_skipped"]]
    assert skipped and skipped[0] == 0  # the window holds the skipped steps from the very first one
    for r in w["rows"][:-1]:
        assert r["low_stepped"] is (not r["recorded_skipped"]) and r["fp32_stepped"] is True
        assert r["low_scale"] == r["recorded_scale"]
    # FP16 retraces the recorded run only if it skips where GradScaler skipped and scales as it scaled
    assert w["reproduction"] < 1e-6 and w["scaler"] is True and w["unrecorded_skips"] == []


def test_steps_on_a_snapshot_without_a_window_is_one_error_line_naming_the_fix(tmp_path):
    model = build_centered()
    opt = torch.optim.Adam(model.parameters())
    with Recorder(tmp_path, model, **REFS, optimizer=opt) as rec:
        train(model, shifted_batches(3), opt=opt, rec=rec, snapshot_at=2)
    res = CliRunner().invoke(cli, ["replay", str(rec.snapshots[0]), "--steps", "4"])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error:"), res.output
    assert str(rec.snapshots[0]) in lines[0] and "Recorder(..., rewind=K)" in lines[0]


def test_replay_steps_of_a_wrong_typed_window_prints_one_error_line_naming_the_file(tmp_path):
    path = _centered_run(tmp_path, torch.bfloat16, 2000.0)[0]
    snap = torch.load(path, weights_only=True)
    snap["rewind"]["steps"][2]["loss"] = "0.5"
    bad = tmp_path / "edited.pt"
    torch.save(snap, bad)
    res = CliRunner().invoke(cli, ["replay", str(bad), "--steps", "2"])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error:") and str(bad) in lines[0]
    assert "rewind" in lines[0]


def test_a_window_of_accumulating_steps_replays_every_micro_batch_as_training_did(tmp_path):
    from tests.analyzer.replay.window_models import centered_loss

    model = build_centered()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = shifted_batches(16)
    with Recorder(tmp_path, model, **REFS, optimizer=opt, amp_dtype=torch.bfloat16, rewind=3) as rec:
        for step in range(8):
            micro = data[2 * step:2 * step + 2]  # two micro-batches per optimizer step, each loss / 2
            rec.begin_step(step, micro)
            step_loss = 0.0
            for part in micro:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = centered_loss(model, part) / 2
                loss.backward()
                step_loss += loss.item()
            rec.end_step(loss * 2)
            if step == 7:
                rec.snapshot()
            opt.step()
            opt.zero_grad()
    w = _window(rec.snapshots[0], 3)
    assert [r["step"] for r in w["rows"]] == [5, 6, 7]
    # the replay's loss is the step's (each micro-batch's / 2, summed), from the weights training reached only
    # if every replayed step summed both micro-batches' gradients
    from analyzer.load import load_snapshot

    rw = load_snapshot(rec.snapshots[0]).rewind
    assert all(s["micro_batches"]["count"] == 2 for s in rw["steps"])
    assert w["rows"][-1]["low_loss"] == pytest.approx(step_loss, rel=1e-6)  # step 7's, both micro-batches
    assert w["reproduction"] is None  # end_step got the last micro-batch's loss x 2: nothing to compare with


def _lbfgs_run(d, reason="manual"):
    from tests.analyzer.replay.window_models import centered_loss

    model = build_centered()
    opt = torch.optim.LBFGS(model.parameters())
    with Recorder(d, model, **REFS, optimizer=opt, rewind=2) as rec:
        for step, batch in enumerate(shifted_batches(4)):
            rec.begin_step(step, batch)

            def closure(batch=batch):
                opt.zero_grad()
                loss = centered_loss(model, batch)
                loss.backward()
                return loss
            rec.end_step(closure())
            if step == 3:
                rec.snapshot(reason)
            opt.step(closure)
    return rec.snapshots[0]


def test_autopsy_says_which_window_it_could_not_replay_and_exits_1(tmp_path):
    snap = _lbfgs_run(tmp_path, "odd")  # a reason of the user's own: autopsy picks it
    res = CliRunner().invoke(cli, ["autopsy", str(tmp_path)])
    assert res.exit_code == 1 and res.output.strip().splitlines()[-1].startswith("Error:"), res.output[-2000:]
    assert f"could not replay the rewind window of {snap}" in res.output


def test_an_optimizer_whose_step_needs_a_closure_is_one_error_line(tmp_path):
    snap = _lbfgs_run(tmp_path)
    res = CliRunner().invoke(cli, ["replay", str(snap), "--steps", "3"])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error:"), res.output
    assert "LBFGS.step() raised TypeError" in lines[0]


def test_a_window_batch_the_model_cannot_take_is_one_error_line_naming_the_step(tmp_path):
    path = _centered_run(tmp_path, torch.bfloat16, 2000.0)[0]
    snap = torch.load(path, weights_only=True)
    snap["rewind"]["steps"][-3]["batch"]["x"] = torch.zeros(4, 5)  # 5 features: lin0 takes 8
    bad = tmp_path / "edited.pt"
    torch.save(snap, bad)
    res = CliRunner().invoke(cli, ["replay", str(bad), "--steps", "6"])
    lines = res.output.strip().splitlines()
    step = snap["rewind"]["steps"][-3]["step"]
    assert res.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error:"), res.output
    assert f"at window step {step}" in lines[0] and str(bad) in lines[0]


def test_autopsy_replays_the_window_of_each_snapshot_that_holds_one(tmp_path):
    snaps = _centered_run(tmp_path, torch.float16, 1e5)
    res = CliRunner().invoke(cli, ["autopsy", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output[-2000:]
    out = json.loads(res.output)
    assert [w["snapshot"] for w in out["windows"]] == [str(snaps[0])]
    assert out["windows"][0]["part_step"] == 30 and len(out["windows"][0]["rows"]) == 6  # Recorder(rewind=6)
    text = CliRunner().invoke(cli, ["autopsy", str(tmp_path)]).output
    assert "rewind window: steps 25..30 replayed from one state in FP32 and float16" in text


def test_autopsy_of_a_run_without_windows_has_no_windows_key(tmp_path):
    model = build_centered()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with Recorder(tmp_path, model, **REFS, optimizer=opt, amp_dtype=torch.float16, spike_window=20) as rec:
        train(model, shifted_batches(32, shift_at=30, offset=1e5), opt=opt, rec=rec, amp_dtype=torch.float16)
    out = json.loads(CliRunner().invoke(cli, ["autopsy", str(tmp_path), "--json"]).output)
    assert out["replays"] and "windows" not in out

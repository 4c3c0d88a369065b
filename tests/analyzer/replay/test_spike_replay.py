"""Spike snapshots of a tiny MLP replayed: an lr jump spikes in FP32 too (instability, with no attention to
name); a spike made by state the snapshot does not hold (a target offset the loop set for one step) does not
reproduce (not_reproduced, never healthy)."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch.nn.functional as F
from click.testing import CliRunner

from analyzer.cli import main
from analyzer.replay import Replay
from recorders import Recorder, schema
from tests.recorders.spike_models import build_plain, linear_batches, train_with_lr_jumps

REFS = {"factory": "tests.recorders.spike_models:build_plain", "loss_fn": "tests.recorders.spike_models:plain_loss"}
OFFSET = {"y": 0.0}  # what offset_loss adds to the targets: set by the loop, held by no snapshot


def offset_loss(model, batch):
    return F.mse_loss(model(batch["x"]).float(), batch["y"] + OFFSET["y"])


def _lr_jump_run(tmp_path, amp_dtype):
    model = build_plain()
    opt = torch.optim.Adam(model.parameters(), lr=0.003)
    with Recorder(tmp_path, model, **REFS, optimizer=opt, amp_dtype=amp_dtype, grad_spike=None) as rec:
        train_with_lr_jumps(model, linear_batches(160), opt=opt, rec=rec, jumps=(100,), amp_dtype=amp_dtype)
    return tmp_path / schema.SNAPSHOT_DIR / schema.snapshot_name(101, 0, "loss_spike")


@pytest.mark.parametrize("amp_dtype", [None, torch.bfloat16])
def test_an_lr_jump_spike_replays_as_instability_naming_the_lr_and_no_attention(tmp_path, amp_dtype):
    res = Replay(_lr_jump_run(tmp_path, amp_dtype), device="cpu").run()
    assert res.verdict == "instability"
    s = res.evidence["spike"]
    assert s.fp32_spikes and s.replayed["float32"] > s.threshold > s.baseline
    # the snapshot is taken before the loop restores the lr: the optimizer still holds the jumped 1000 x 0.003
    assert s.mechanism.attention == {} and s.mechanism.lr == pytest.approx(3.0)
    assert "attention" not in res.summary and not any("QK-layernorm" in a for a in res.advice)
    assert any("(lr 3)" in a for a in res.advice)
    # the trace's lr before the jump is the usual 0.003: the advice says the lr is 1000x that
    assert s.mechanism.trace.lr_median == pytest.approx(0.003) and any("1e+03x its trailing median" in a
                                                                        for a in res.advice)
    assert s.mechanism.trace.weight_norm > s.mechanism.trace.weight_norm_median  # the jumped update grew the weights
    assert res.culprit is None and "fp32_comparison" not in res.evidence


def test_a_spike_the_replay_does_not_make_is_not_reproduced(tmp_path):
    model = build_plain()
    opt = torch.optim.Adam(model.parameters(), lr=0.003)
    with Recorder(tmp_path, model, factory=REFS["factory"], loss_fn=f"{__name__}:offset_loss", optimizer=opt,
                  grad_spike=None) as rec:
        for step, batch in enumerate(linear_batches(130)):
            OFFSET["y"] = 30.0 if step == 110 else 0.0  # one step's targets moved by state outside the snapshot
            rec.begin_step(step, batch)
            loss = offset_loss(model, batch)
            loss.backward()
            rec.end_step(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
    OFFSET["y"] = 0.0
    snap = tmp_path / schema.SNAPSHOT_DIR / schema.snapshot_name(110, 0, "loss_spike")
    res = CliRunner().invoke(main, ["replay", str(snap), "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.output[res.output.index("{"):])
    assert obj["verdict"] == "not_reproduced"
    nr = obj["not_reproduced"]
    assert nr["recorded"].startswith("a loss spike") and nr["spike_replayed"]["float32"] < obj["spike"]["threshold"]
    assert "the spike did not reproduce" in obj["summary"]


_LR_JUMP: list = []
_NUMBERS = st.one_of(st.none(), st.floats(), st.integers(-2**70, 2**70), st.text(max_size=8), st.sampled_from(
    ["loss", "grad_norm"]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entry=st.dictionaries(st.sampled_from(schema.SPIKE_KEYS), _NUMBERS, max_size=len(schema.SPIKE_KEYS)))
def test_any_spike_entry_that_loads_replays_to_a_verdict_or_one_error_line(tmp_path_factory, entry):
    if not _LR_JUMP:
        _LR_JUMP.append(_lr_jump_run(tmp_path_factory.mktemp("jump"), None))
    snap = torch.load(_LR_JUMP[0], weights_only=True)
    snap["spike"] = entry
    path = tmp_path_factory.mktemp("s") / _LR_JUMP[0].name
    torch.save(snap, path)
    res = CliRunner().invoke(main, ["replay", str(path), "--device", "cpu", "--json"])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    if res.exit_code == 1:
        assert res.output.count("Error:") == 1 and "Traceback" not in res.output
        return
    assert res.exit_code == 0, res.output
    obj = json.loads(res.output[res.output.index("{"):])
    assert obj["verdict"] in ("instability", "not_reproduced", "healthy", "precision_error")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_spike_beside_a_damaged_trace_still_replays_as_instability_without_the_trace(tmp_path, damage):
    snap = _lr_jump_run(tmp_path, None)
    for part in sorted((tmp_path / "trace").glob("*.parquet")):
        data = part.read_bytes()
        part.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00garbage" * 64)
    res = CliRunner().invoke(main, ["replay", str(snap), "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.output[res.output.index("{"):])
    assert obj["verdict"] == "instability" and obj["spike"]["mechanism"]["trace"] is None
    assert obj["spike"]["mechanism"]["lr"] == pytest.approx(3.0)  # the snapshot's own optimizer state still speaks


def test_a_spike_fp32_misses_by_less_than_the_precision_tolerance_is_still_instability(tmp_path):
    # the threshold moved between the two replayed losses: one precision crosses it, the other does not, and the
    # two steps are within the FP32 tolerance of each other (53.52 in BF16 and 53.46 in FP32 on AVX-512)
    path = _lr_jump_run(tmp_path, torch.bfloat16)
    first = Replay(path, device="cpu").run().evidence["spike"].replayed
    low, fp32 = first["bfloat16"], first["float32"]
    snap = torch.load(path, weights_only=True)
    snap["spike"] = {**snap["spike"], "threshold": (low + fp32) / 2}
    torch.save(snap, path)
    res = Replay(path, device="cpu").run()
    assert res.verdict == "instability" and "fp32_comparison" not in res.evidence
    s = res.evidence["spike"]
    if low > fp32:  # BF16 crosses, FP32 does not: not the precision's doing, within tolerance
        assert s.low_spikes and not s.fp32_spikes and s.fp32_within_tolerance
        assert "just under the threshold but within the precision tolerance" in res.summary
    else:  # the kernels rounded the other way: FP32 crosses
        assert s.fp32_spikes and not s.low_spikes

"""Spike snapshots on real tiny runs: an lr jump writes them, healthy runs do not, the cap, no extra host read."""
from __future__ import annotations

import json
import math

import polars as pl
import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main as cli
from analyzer.load import load_run, load_snapshot
from recorders import Recorder, schema
from recorders._meta import RecorderConfig
from tests.recorders.spike_models import build_plain, linear_batches, train_with_lr_jumps

REFS = {"factory": "tests.recorders.spike_models:build_plain", "loss_fn": "tests.recorders.spike_models:plain_loss"}


def _run(tmp_path, steps=240, jumps=(), opt="adam", returned=None, amp_dtype=None, **kw):
    model = build_plain()
    o = torch.optim.Adam(model.parameters(), lr=0.003) if opt == "adam" else \
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with Recorder(tmp_path, model, **REFS, optimizer=o, amp_dtype=amp_dtype, **kw) as rec:
        losses = train_with_lr_jumps(model, linear_batches(steps), opt=o, rec=rec, jumps=jumps, returned=returned,
                                     amp_dtype=amp_dtype)
    return losses, sorted(p.name for p in (tmp_path / schema.SNAPSHOT_DIR).glob("*.pt"))


def test_an_lr_jump_writes_one_loss_spike_snapshot_on_the_step_after_it(tmp_path):
    returned = []
    losses, snaps = _run(tmp_path, jumps=(100,), returned=returned, grad_spike=None)
    assert losses[101] > 20 * sorted(losses[50:100])[25]  # the real spike: the loss after the 1000x step
    assert snaps == [schema.snapshot_name(101, 0, "loss_spike")]
    assert all(r is None for r in returned)  # a spike is no failure: `if rec.end_step(loss): break` trains on


@pytest.mark.parametrize("amp_dtype", [None, torch.bfloat16])
def test_with_both_triggers_on_the_first_spike_snapshot_is_the_loss_at_the_jumped_step(tmp_path, amp_dtype):
    _, snaps = _run(tmp_path, jumps=(100,), amp_dtype=amp_dtype)
    assert snaps[0] == schema.snapshot_name(101, 0, "loss_spike")
    assert len(snaps) <= 2 and all(schema.SNAPSHOT_RE.match(s)[4] in ("loss_spike", "grad_spike") for s in snaps)


@pytest.mark.parametrize("opt", ["adam", "sgd"])
@pytest.mark.parametrize("amp_dtype", [None, torch.bfloat16])
def test_a_healthy_run_writes_no_spike_snapshot(tmp_path, opt, amp_dtype):
    losses, snaps = _run(tmp_path, steps=600, opt=opt, amp_dtype=amp_dtype)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert snaps == []


def test_spike_snapshots_stop_at_max_spike_snapshots(tmp_path):
    jumps = (100, 250, 400)  # each more than a window (100 steps) after the last
    _, snaps = _run(tmp_path / "two", steps=500, jumps=jumps, grad_spike=None, max_spike_snapshots=2)
    assert snaps == [schema.snapshot_name(s + 1, 0, "loss_spike") for s in jumps[:2]]
    _, snaps = _run(tmp_path / "all", steps=500, jumps=jumps, grad_spike=None, max_spike_snapshots=5)
    assert snaps == [schema.snapshot_name(s + 1, 0, "loss_spike") for s in jumps]
    _, snaps = _run(tmp_path / "none", steps=500, jumps=jumps, max_spike_snapshots=0)
    assert snaps == []


def test_spike_snapshots_leave_the_max_snapshots_budget_to_failures(tmp_path):
    _, snaps = _run(tmp_path, jumps=(100,), grad_spike=None, max_snapshots=0)
    assert snaps == [schema.snapshot_name(101, 0, "loss_spike")]


def test_both_triggers_off_write_nothing_and_meta_says_so(tmp_path):
    _, snaps = _run(tmp_path, jumps=(100,), loss_spike=None, grad_spike=None)
    assert snaps == []
    assert json.loads((tmp_path / schema.META_FILE).read_text())["spikes"] is None


def test_a_spike_snapshot_round_trips_with_its_measurement_and_the_run_its_settings(tmp_path):
    losses, _ = _run(tmp_path, jumps=(100,), grad_spike=None, spike_window=40, layer_every=7)
    snap = load_snapshot(tmp_path / schema.SNAPSHOT_DIR / schema.snapshot_name(101, 0, "loss_spike"))
    assert snap.reason == "loss_spike" and snap.step == 101 and snap.format_version == schema.FORMAT_VERSION
    assert tuple(snap.spike) == schema.SPIKE_KEYS
    sp = snap.spike
    assert sp["metric"] == "loss" and sp["value"] == pytest.approx(losses[101]) and snap.loss == sp["value"]
    assert sp["baseline"] == pytest.approx(sorted(losses[61:101])[19:21], rel=1e-9) or \
        min(losses[61:101]) <= sp["baseline"] <= max(losses[61:101])
    assert sp["ratio"] == pytest.approx(sp["value"] / sp["baseline"]) and sp["value"] > sp["threshold"]
    assert sp["factor"] == 3.0 and sp["window"] == 40
    meta = json.loads((tmp_path / schema.META_FILE).read_text())
    assert meta["spikes"] == {"loss_spike": 3.0, "grad_spike": None, "spike_window": 40, "max_spike_snapshots": 2}
    assert meta["format_version"] == schema.FORMAT_VERSION
    run = load_run(tmp_path)
    # the spike step has its layer row though layer_every=7 does not fall on it
    assert run.layers.filter(pl.col("step") == 101).collect().height == len(run.params)
    # a model rebuilt from the snapshot reproduces the spiking loss
    from tests.recorders.spike_models import plain_loss

    model = build_plain()
    model.load_state_dict(snap.model_state)
    assert plain_loss(model, snap.batch).item() == pytest.approx(sp["value"], rel=1e-5)


def test_analyzer_report_lists_the_spike_snapshots(tmp_path):
    _run(tmp_path, jumps=(100,))
    res = CliRunner().invoke(cli, ["report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert schema.snapshot_name(101, 0, "loss_spike") in res.output
    res = CliRunner().invoke(cli, ["report", str(tmp_path), "--json"])
    obj = json.loads(res.output)
    assert {"loss_spike"} <= {s["reason"] for s in obj["snapshots"]}
    assert any(f["check"] == "loss_spike" and f["step"] == 101 for f in obj["findings"])


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the reads of tensor values into Python (item, tolist) inside its block."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.item, torch.Tensor.tolist):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _reads_per_step(tmp_path, **kw) -> list[int]:
    model = build_plain()
    opt = torch.optim.Adam(model.parameters(), lr=0.003)
    counts = []
    with Recorder(tmp_path, model, **REFS, optimizer=opt, flush_every=1000, spike_window=20, **kw) as rec:
        for step, batch in enumerate(linear_batches(60)):
            rec.begin_step(step, batch)
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            loss.backward()
            with _HostReads() as mode:
                rec.end_step(loss)
            counts.append(mode.n)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return counts


@pytest.mark.parametrize("layer_every", [1, 5])
def test_the_spike_triggers_add_no_host_read_to_a_step(tmp_path, layer_every):
    on = _reads_per_step(tmp_path / "on", layer_every=layer_every)
    off = _reads_per_step(tmp_path / "off", layer_every=layer_every, loss_spike=None, grad_spike=None)
    assert not (tmp_path / "on" / schema.SNAPSHOT_DIR).exists()  # healthy steps only, past the warm-up
    assert on == off and max(on) >= 1  # the reads the step already makes are seen, and no more


@pytest.mark.parametrize("kw, name", [
    ({"loss_spike": 1.0}, "loss_spike"), ({"loss_spike": 0.5}, "loss_spike"), ({"grad_spike": math.inf}, "grad_spike"),
    ({"grad_spike": "10"}, "grad_spike"), ({"loss_spike": True}, "loss_spike"), ({"spike_window": 9}, "spike_window"),
    ({"spike_window": 50.0}, "spike_window"), ({"max_spike_snapshots": -1}, "max_spike_snapshots"),
    ({"max_spike_snapshots": False}, "max_spike_snapshots"),
])
def test_bad_spike_settings_name_themselves(kw, name):
    with pytest.raises(ValueError, match=name):
        RecorderConfig(**kw)
    with pytest.raises(ValueError, match=name):
        Recorder("unused", build_plain(), **kw)


def test_a_version_6_snapshot_and_run_without_the_spike_keys_still_load(tmp_path):
    _run(tmp_path, jumps=(100,), grad_spike=None)
    path = tmp_path / schema.SNAPSHOT_DIR / schema.snapshot_name(101, 0, "loss_spike")
    snap = torch.load(path, weights_only=True)
    del snap["spike"]
    snap["format_version"] = 6
    old = tmp_path / "old.pt"
    torch.save(snap, old)
    assert load_snapshot(old).spike is None and load_snapshot(old).reason == "loss_spike"
    meta = json.loads((tmp_path / schema.META_FILE).read_text())
    del meta["spikes"]
    meta["format_version"] = 6
    (tmp_path / schema.META_FILE).write_text(json.dumps(meta))
    assert load_run(tmp_path).meta.get("spikes") is None


@pytest.mark.slow
def test_a_bf16_tiny_gpt_without_attention_scaling_at_a_high_lr_writes_a_loss_spike_snapshot(tmp_path):
    # attention logits not divided by sqrt(d), Adam at a constant 0.03: the loss falls, then jumps (step ~680 here)
    from samples import models as sm
    from samples._common import gpt_batches, one_thread

    kwargs = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, scale_attn_logits=False)
    torch.manual_seed(0)
    model = sm.build_gpt(**kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    data = gpt_batches(vocab_size=32, block_size=16, batch_size=16, seed=0)
    losses = []
    with one_thread(), Recorder(tmp_path, model, factory=f"{sm.__name__}:build_gpt", factory_kwargs=kwargs,
                                loss_fn=f"{sm.__name__}:gpt_loss", optimizer=opt, amp_dtype=torch.bfloat16) as rec:
        for step in range(900):
            batch = next(data)
            rec.begin_step(step, batch)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = sm.gpt_loss(model, batch)
            loss.backward()
            rec.end_step(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if rec.snapshots and any("loss_spike" in p.name for p in rec.snapshots) and step > 0:
                break
    spikes = [p for p in rec.snapshots if "loss_spike" in p.name]
    assert spikes, "no loss_spike snapshot in 900 steps"
    snap = load_snapshot(spikes[0])
    s = snap.step
    assert losses[s] >= 3 * sorted(losses[s - 100:s])[50] and snap.spike["ratio"] >= 3
    assert all(schema.SNAPSHOT_RE.match(p.name)[4] in ("loss_spike", "grad_spike") for p in rec.snapshots)

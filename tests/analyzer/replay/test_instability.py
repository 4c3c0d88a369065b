"""A BF16 tiny GPT pushed into attention logit growth writes a loss_spike snapshot; its replay spikes in FP32 too.

Attention logits not divided by sqrt(head_dim), Adam at a constant lr of 0.03: the loss falls, then jumps
(tests/recorders/test_spikes.py trains the same run). The run is trained once per session, with the loss
trigger only: with both on, this run's first snapshot is a grad_spike at step 270 whose FP32 replay does not
spike and whose BF16 gradient is far from FP32's (a precision_error, which autopsy then puts first).
"""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main
from analyzer.replay import Replay
from recorders import Recorder

pytestmark = pytest.mark.slow

_RUN: list = []
KWARGS = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, scale_attn_logits=False)


@pytest.fixture(scope="session")
def spike_run(tmp_path_factory):
    if not _RUN:
        from samples import models as sm
        from samples._common import gpt_batches, one_thread

        out = tmp_path_factory.mktemp("gpt_spike") / "run"
        torch.manual_seed(0)
        model = sm.build_gpt(**KWARGS)
        opt = torch.optim.Adam(model.parameters(), lr=0.03)
        data = gpt_batches(vocab_size=32, block_size=16, batch_size=16, seed=0)
        with one_thread(), Recorder(out, model, factory=f"{sm.__name__}:build_gpt", factory_kwargs=KWARGS,
                                    loss_fn=f"{sm.__name__}:gpt_loss", optimizer=opt, amp_dtype=torch.bfloat16,
                                    grad_spike=None, rewind=8) as rec:
            for step in range(3000):  # the first spike: step 285 under AVX-512, 1324 under the default kernels
                batch = next(data)
                rec.begin_step(step, batch)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = sm.gpt_loss(model, batch)
                loss.backward()
                rec.end_step(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
                if any("loss_spike" in p.name for p in rec.snapshots):
                    break
        spikes = [p for p in rec.snapshots if "loss_spike" in p.name]
        assert spikes, "no loss_spike snapshot in 3000 steps"
        _RUN.append((out, spikes[0]))
    return _RUN[0]


def test_the_spike_replays_as_instability_naming_the_attention_logits(spike_run):
    _, snap = spike_run
    res = Replay(snap, device="cpu").run()
    assert res.verdict == "instability"
    s = res.evidence["spike"]
    assert s.fp32_spikes and s.replayed["float32"] > s.threshold  # FP32 makes the spike too
    m = s.mechanism
    module, logit = m.top_attention()
    assert module.startswith("blocks.") and module.endswith(".attn")
    assert 50 < logit < float("inf")  # unscaled q.k^T has grown; the -inf of the causal mask is no logit
    assert m.log_partition_max is not None and m.logit_absmax is not None and m.lr == pytest.approx(0.03)
    assert f"in `{module}`" in res.summary and "precision" not in res.summary.replace("the low precision did not", "")
    assert any("QK-layernorm" in a for a in res.advice)
    assert "fp32_comparison" not in res.evidence and res.culprit is None  # no precision verdict, no op blamed


def test_the_rewind_window_measures_the_top_attention_logit_at_each_step_before_the_spike(spike_run):
    _, snap = spike_run
    res = Replay(snap, device="cpu").run()
    m = res.evidence["spike"].mechanism
    module, logit = m.top_attention()
    g = m.to_dict()["attention_logit_growth"]
    rw = Replay(snap, device="cpu").snapshot.rewind
    assert g["module"] == module and g["precision"] == "bfloat16"
    assert g["steps"] == [s["step"] for s in rw["steps"]] and g["steps"][-1] == res.step  # every window step
    assert len(g["logits"]) == len(g["steps"]) and all(v > 0 for v in g["logits"])
    # the window, replayed as training ran it, ends at the step's own weights; its BF16 forward rounds q and k
    # to 8 bits, so its logit is near, not equal to, the FP32 forward's of the same weights (3216 vs 3005 here)
    assert g["last"] == pytest.approx(logit, rel=0.15)
    assert g["factor"] == pytest.approx(g["last"] / g["first"])
    assert f"to {g['last']:.4g} at step {res.step}" in res.summary


def test_autopsy_of_the_spike_run_says_instability_and_verifies_nothing(spike_run):
    run_dir, _ = spike_run
    res = CliRunner().invoke(main, ["autopsy", str(run_dir), "--device", "cpu", "--json"])
    assert res.exit_code in (0, 1), res.output
    obj = json.loads(res.output[res.output.index("{"):])
    assert obj["verdict"] == "instability", obj["verdict"]
    assert '"verified"' not in json.dumps(obj)  # no fix was tried on the step, so nothing is verified

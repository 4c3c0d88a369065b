"""Why an overflow's value got large, and attention advice only where the recorded ops show attention.

Real recorded steps, replayed for real:
- the demo (``samples/fp16_attention_overflow.py``): ``tau = 1e-5`` reaches the logits as
  ``q * tau.rsqrt()`` and ``k * tau.rsqrt()``; the replay must name that rsqrt, and must not offer
  "divide by sqrt(d)" (head_dim 16 leaves the largest logit near 85,000, past 65504);
- a Gram matrix ``h @ h^T`` in a module named ``attn`` that no softmax reads: no attention advice,
  and no magnitude jump (its inputs come straight from a Linear of the batch).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from analyzer.render import render_replay_text
from analyzer.replay import replay_snapshot
from analyzer.replay.detection._magnitude import MIN_GROWTH
from recorders import Recorder
from samples import fp16_attention_overflow as demo
from tests.sample_runs import demo_run, sample_run

REF = "tests.analyzer.replay.test_magnitude"


@pytest.fixture(scope="module")
def demo_replay(tmp_path_factory):
    run = sample_run(tmp_path_factory, "fp16_attention_overflow")
    first = sorted((run / "snapshots").glob("*-nonfinite_loss.pt"))[0]  # its step moves with the CPU: read it
    return replay_snapshot(first)


def _edges(trace, upto: int) -> list[float]:
    """Every forward op's first output abs-max over each input that an earlier op computed."""
    out = []
    for rec in trace.records[:upto]:
        if rec.phase != "forward" or not rec.outputs or rec.name.endswith(("view", "_to_copy", "expand", "clone")):
            continue
        o = trace.absmax[rec.outputs[0]]
        for s, p in rec.inputs:
            v = trace.absmax[s]
            if p is not None and trace.records[p].inputs and v > 0 and math.isfinite(o):
                out.append(o / v)
    return out


def test_the_demo_overflow_names_the_rsqrt_of_tau_that_multiplied_the_logits_inputs(demo_replay):
    r = demo_replay
    assert r.verdict == "overflow" and r.culprit["op"] == "aten.bmm"
    j = r.culprit["magnitude_jump"]
    f = j["factor"]
    assert (f["op"], f["module"], f["reads"]) == ("aten.rsqrt", "blocks.0.attn", "blocks.0.attn.temperature")
    assert f["reads_absmax"] == pytest.approx(demo.TAU_FINAL, rel=1e-6)  # the buffer the loop set
    assert f["absmax"] == pytest.approx(demo.TAU_FINAL ** -0.5, rel=1e-3)  # rsqrt(1e-5) = 316
    # checked against the trace: the jump is a mul reading the rsqrt, both culprit inputs come from such a mul
    t = r.culprit_trace
    assert t.records[f["index"]].name == "aten.rsqrt" and t.records[j["index"]].name == "aten.mul"
    assert [a["op"] for a in j["applied_by"]] == ["aten.mul", "aten.mul"] and j["direct"]
    for a in j["applied_by"]:
        assert f["index"] in [p for _, p in t.records[a["index"]].inputs]
    assert j["growth"] == pytest.approx(j["output_absmax"] / j["input_absmax"])
    # the largest growth, up to the 1% within which the earlier op wins a tie (_magnitude._TIE)
    assert j["growth"] >= max(_edges(t, r.culprit["index"])) / (1 + 1e-2) and j["growth"] >= MIN_GROWTH
    d = json.loads(json.dumps(r.to_dict(), allow_nan=False))  # strict JSON, the same key in --json
    assert d["culprit"]["magnitude_jump"]["factor"]["reads"] == "blocks.0.attn.temperature"
    ops = " and ".join(f"#{a['index']}" for a in j["applied_by"])
    assert (f"Why so large: the culprit's inputs were multiplied by {f['absmax']:.3g} (aten.mul at "
            f"{j['source']}, ops {ops}), the aten.rsqrt of `blocks.0.attn.temperature` = 1e-05") in r.summary


def test_the_demo_is_not_told_to_divide_by_sqrt_d_because_its_number_stays_past_the_max(demo_replay):
    r = demo_replay
    hd = demo.GPT_KWARGS["n_embd"] // demo.GPT_KWARGS["n_head"]  # 16
    logit = r.culprit["shadow"]["float32"]
    assert logit / math.sqrt(hd) > 65504  # the reason the line below may not recommend it
    assert not [a for a in r.advice if a.startswith("Divide the attention logits")]
    line, = [a for a in r.advice if a.startswith("Dividing the attention logits")]
    assert f"sqrt(head_dim) = {math.sqrt(hd):.3g} is not enough here" in line
    assert f"{logit:.3g} in FP32, would still be {logit / math.sqrt(hd):.3g}, past float16's max 65504" in line
    # a statement the replay's values check, not something to try: printed under "checked", never as advice
    assert [a.checked for a in r.advice_lines if a.text == line] == [True]
    text = render_replay_text(r)
    assert line not in text.split("what to try:", 1)[1].split("checked:", 1)[0]
    assert line in text.split("checked:", 1)[1]


def test_the_demo_replay_runs_bf16_for_its_bf16_advice_and_prints_nothing_untested(demo_replay):
    r = demo_replay
    assert r.runs["bfloat16"]["finite"]  # the run the "Switch to BF16" line rests on
    assert r.runs["bfloat16"]["scale"] == 1.0 and "bfloat16  loss" in render_replay_text(r)
    assert "finite (at loss scale 1)" in render_replay_text(r)  # BF16 trains without a GradScaler
    assert any(a.startswith("Switch to BF16") for a in r.advice)
    assert not [a for a in r.advice if "untested" in a]


def test_the_demos_autopsy_answer_leads_with_the_rsqrt_of_tau_and_verifies_bf16_without_untested_marks(
        tmp_path_factory, demo_replay):
    demo = demo_run(tmp_path_factory)  # `analyzer demo`: the autopsy of the same run
    answer = demo.output.split("answer:", 1)[1].split("evidence 1/", 1)[0].splitlines()
    root = next(line for line in answer if line.strip().startswith("root cause: overflow:"))
    assert "the aten.rsqrt of `blocks.0.attn.temperature` = 1e-05" in root
    assert demo_replay.summary.split("Why so large: ", 1)[1] in root  # the same sentence as the replay's
    assert not [line for line in answer if "Divide the attention logits" in line]
    assert [line for line in answer if "verified fix: switch from FP16 to BF16" in line]
    assert not [line for line in answer if "BF16" in line and "untested advice" in line]
    assert [line for line in answer if line.strip().startswith("checked: Dividing the attention logits")]
    assert not [line for line in answer if "untested advice: Dividing" in line]


# -- a Gram matrix, no softmax: no attention advice ---------------------------------------------------
class Gram(nn.Module):
    def __init__(self, boost: float):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.boost = boost

    def forward(self, x):
        h = self.proj(x)
        if self.boost:
            h = h * self.boost  # a Python number: no op computes the factor
        return (h @ h.transpose(-2, -1)).mean(-1, keepdim=True)  # a bmm no softmax reads


class GramNet(nn.Module):
    def __init__(self, boost: float = 0.0):
        super().__init__()
        self.attn = Gram(boost)  # named like attention on purpose: the advice must read the ops, not the name
        with torch.no_grad():
            self.attn.proj.weight.copy_(torch.eye(8) * 4)
            self.attn.proj.bias.zero_()

    def forward(self, x):
        return self.attn(x)


def build_gram(boost: float = 0.0) -> nn.Module:
    return GramNet(boost)


def gram_loss(model, batch):
    return (model(batch["x"]) / 1e5).float().pow(2).mean()


def _gram_step(run_dir: Path, x: float = 30.0, boost: float = 0.0) -> Path:
    model = build_gram(boost)
    # |h| = 4 * 30 = 120 per entry over 8 entries: h.h ~ 8 * 120^2 = 1.2e5 > 65504 on the diagonal
    batch = {"x": torch.full((2, 4, 8), x)}
    with Recorder(run_dir, model, factory=f"{REF}:build_gram", factory_kwargs={"boost": boost},
                  loss_fn=f"{REF}:gram_loss", amp_dtype=torch.float16) as rec:
        rec.begin_step(0, batch)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = gram_loss(model, batch)
        loss.backward()
        assert rec.end_step(loss) is not None
    return rec.snapshots[-1]


def test_a_bmm_overflow_that_no_softmax_reads_gets_no_attention_advice_and_no_jump(tmp_path):
    r = replay_snapshot(_gram_step(tmp_path / "run"))
    assert r.verdict == "overflow" and (r.culprit["op"], r.culprit["module"]) == ("aten.bmm", "attn")
    assert not [a for a in r.advice if "attention" in a or "sqrt" in a]
    # its inputs come from a Linear of the batch: parameters and the batch are read, not grown
    assert "magnitude_jump" not in r.culprit and "Why so large" not in r.summary


def test_a_value_multiplied_by_a_python_number_names_the_mul_and_its_growth_without_a_factor(tmp_path):
    # h = 4 * 1 = 4 per entry, times 100: 400, and 8 * 400^2 = 1.28e6 > 65504; without the boost 8 * 16 = 128
    r = replay_snapshot(_gram_step(tmp_path / "run", x=1.0, boost=100.0))
    assert r.verdict == "overflow" and r.culprit["op"] == "aten.bmm"
    j = r.culprit["magnitude_jump"]
    t = r.culprit_trace
    rec = t.records[j["index"]]
    assert (j["op"], j["module"], j["factor"]) == ("aten.mul", "attn", None) and rec.name == "aten.mul"
    assert j["input_absmax"] == t.absmax[rec.inputs[0][0]] == 4.0 and j["output_absmax"] == 400.0
    assert j["growth"] == pytest.approx(100.0)  # the boost itself
    assert (f"Why so large: aten.mul in `attn` ({j['source']}, op #{j['index']}) took a value of abs-max 4 to "
            f"400: the largest jump in magnitude (x100) among the {j['ops_fed']} ops that fed the culprit.") \
        in r.summary


# -- attention with dropout on its probabilities: still attention -----------------------------------------
class DropAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(8, 8, bias=False)  # one projection for q, k and v
        self.drop = nn.Dropout(0.1)
        with torch.no_grad():
            self.attn.weight.copy_(torch.eye(8) * 4)

    def forward(self, x):
        q = self.attn(x)
        att = self.drop((q @ q.transpose(-2, -1)).softmax(-1))  # nanoGPT's attn_dropout
        return att @ q


def build_drop_attn() -> nn.Module:
    return DropAttn()


def test_attention_with_dropout_on_its_probabilities_gets_the_sqrt_d_line_with_its_numbers(tmp_path):
    # q = 4 * 30 = 120 per entry, logits 8 * 120^2 = 115200 > 65504; / sqrt(8) = 40729 < 65504
    model = build_drop_attn()
    batch = {"x": torch.full((2, 4, 8), 30.0)}
    with Recorder(tmp_path / "run", model, factory=f"{REF}:build_drop_attn", loss_fn=f"{REF}:gram_loss",
                  amp_dtype=torch.float16) as rec:
        rec.begin_step(0, batch)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = gram_loss(model, batch)
        loss.backward()
        assert rec.end_step(loss) is not None
    r = replay_snapshot(rec.snapshots[-1])
    assert r.verdict == "overflow" and r.culprit["op"] == "aten.bmm"
    logit = r.culprit["shadow"]["float32"]
    assert logit == pytest.approx(8 * 120.0**2, rel=1e-3)
    line, = [a for a in r.advice if a.startswith("Divide the attention logits")]
    assert f"the largest logit, {logit:.3g} in FP32, becomes {logit / math.sqrt(8):.3g}, under float16's max" in line

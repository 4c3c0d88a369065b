"""The recorder's FP8 statistics on real torchao FP8 training (CPU): the fp8 snapshot, the trace rows, the report."""
from __future__ import annotations

import json
import warnings

import polars as pl
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from analyzer.cli import main as cli
from analyzer.load import load_run, load_snapshot
from recorders import Recorder, schema
from recorders.recorder import RecorderWarning
from recorders.fp8 import cast_stats
from tests.analyzer.replay.fp8 import swiglu_models as sm
from tests.extras import require

float8 = require("torchao.float8", "fp8")

REFS = {"factory": f"{sm.REF}:build", "loss_fn": f"{sm.REF}:lm_loss"}


def _convert(model: nn.Module, recipe: str) -> nn.Module:
    return float8.convert_to_float8_training(model, config=float8.Float8LinearConfig.from_recipe_name(recipe))


def _train(run_dir, model, batches, compute_loss, *, steps=4, **kw) -> tuple[Recorder, list]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    returned = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecorderWarning)  # the recorder neither stopped nor warned
        with Recorder(run_dir, model, optimizer=opt, **kw) as rec:
            for step in range(steps):
                b = batches(step)
                rec.begin_step(step, b)
                with torch.autocast("cpu", dtype=kw.get("amp_dtype") or torch.bfloat16, enabled="amp_dtype" in kw):
                    loss = compute_loss(model, b)
                loss.backward()
                returned.append(rec.end_step(loss))
                opt.step()
                opt.zero_grad()
    return rec, returned


def _swiglu(tmp_path, aligned=True, recipe="tensorwise", **kw):
    rec, returned = _train(tmp_path, _convert(sm.build(aligned), recipe), sm.batch, sm.lm_loss, **REFS, **kw)
    return rec, returned


def _fp8_names(rec) -> list[str]:
    return [p.name for p in rec.snapshots if p.name.endswith("-fp8.pt")]


def test_aligned_swiglu_under_tensorwise_writes_an_fp8_snapshot_naming_w2s_input(tmp_path):
    rec, returned = _swiglu(tmp_path, fp8_every=1)
    assert _fp8_names(rec) == [schema.snapshot_name(0, 0, schema.FP8)]  # edge-triggered: it stays above, once
    assert returned == [None] * 4  # an fp8 snapshot is no training failure
    snap = load_snapshot(rec.snapshots[0])  # weights_only, validated
    fired = snap.fp8["fired"]
    assert (fired["module"], fired["role"], fired["use"], fired["format"], fired["granularity"]) == \
        ("block.mlp.w2", "input", "forward", "e4m3", "tensorwise")
    # the rare token's channel reaches ~2e4 (GAIN * sqrt(DIM))**2 ... while the rest is ~0.01: one scale 448 / 2e4
    # flushes most of the tensor (swiglu_models' docstring; fp8-readiness measures 97.8% on this model)
    assert fired["flushed_frac"] > 0.5 and fired["amax"] > 1e4
    assert fired["flushed_frac"] == fired["flushed"] / fired["nonzero"]
    assert snap.fp8_recipe["configs"][0]["roles"]["grad_output"]["format"] == "e5m2"
    roles = {(c["module"], c["role"]) for c in snap.fp8["casts"]}
    assert ("block.mlp.w2", "grad_output") in roles and ("head", "weight") in roles and len(roles) == 6 * 3
    # tensorwise: each operand's second GEMM casts it under the same one scale and format, counted once, as its first
    assert {(c["role"], c["use"]) for c in snap.fp8["casts"]} == set(schema.FP8_FIRST_USE.items())


def test_the_recorded_input_cast_equals_cast_stats_of_the_operand_the_module_received(tmp_path):
    model = _convert(sm.build(True), "tensorwise")
    seen = []
    model.block.mlp.w2.register_forward_hook(lambda m, a, o: seen.append(a[0].detach().clone()))
    rec, _ = _train(tmp_path, model, sm.batch, sm.lm_loss, steps=1, fp8_every=1)
    want = cast_stats(seen[0], "e4m3", "tensorwise")
    row = load_run(tmp_path).fp8.filter((pl.col("module") == "block.mlp.w2") & (pl.col("role") == "input")).collect()
    assert row.height == 1
    assert (row["numel"][0], row["nonzero"][0], row["flushed"][0], row["subnormal"][0], row["saturated"][0]) == \
        (want.numel, want.nonzero, want.flushed, want.subnormal, want.saturated)
    assert row["scale_max"][0] == pytest.approx(want.scale_max)


@pytest.mark.parametrize("aligned, recipe", [(True, "rowwise"), (False, "tensorwise"), (False, "rowwise")])
def test_rowwise_scaling_or_no_aligned_channel_writes_no_fp8_snapshot(tmp_path, aligned, recipe):
    rec, _ = _swiglu(tmp_path, aligned=aligned, recipe=recipe, fp8_every=1)
    assert _fp8_names(rec) == []
    fp8 = load_run(tmp_path).fp8.collect()
    # measured all the same: 4 steps x 6 Linears x 3 roles, x 2 GEMMs reading each under rowwise scaling (the second
    # scaled along the other axis), once under one tensorwise scale
    assert fp8.height == 4 * 6 * 3 * (2 if recipe == "rowwise" else 1)
    assert len(set(fp8["use"])) == (3 if recipe == "rowwise" else 2)
    assert (fp8["flushed"] / fp8["nonzero"]).max() < schema.FP8_FLUSH_LIMIT


def test_a_recipe_whose_weight_gradient_is_high_precision_counts_only_the_fp8_casts(tmp_path):
    # torchao's rowwise_with_gw_hp (FP32 here: it refuses CPU autocast): the weight-gradient GEMM reads input and
    # grad_output unscaled, the input-gradient GEMM reads the weight under one tensorwise scale
    rec, _ = _train(tmp_path, _convert(sm.build(False), "rowwise_with_gw_hp"), sm.batch, sm.lm_loss, steps=1,
                    fp8_every=1, **REFS)
    fp8 = load_run(tmp_path).fp8.collect()
    casts = {(r["role"], r["use"], r["granularity"]) for r in fp8.iter_rows(named=True)}
    assert casts == {("input", "forward", "rowwise"), ("weight", "forward", "rowwise"),
                     ("weight", "input gradient", "tensorwise"), ("grad_output", "input gradient", "rowwise")}
    assert fp8.height == 6 * 4


class _Gated(nn.Module):
    """Two Linears with a gate between them: a gate of 0 makes the second one's input, and the first one's
    grad_output, all zeros."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(32, 32, bias=False), nn.Linear(32, 16, bias=False)

    def forward(self, x, gate):
        return self.b(torch.relu(self.a(x)) * gate)


def _gated_loss(model, batch):
    return (model(batch["x"], batch["gate"]) - batch["y"]).pow(2).mean()


def _gated_batch(step):
    g = torch.Generator().manual_seed(step)
    return {"x": torch.randn(16, 32, generator=g), "y": torch.randn(16, 16, generator=g),
            "gate": torch.tensor(0.0 if step == 2 else 1.0)}


def test_an_all_zero_operand_at_one_step_writes_no_fp8_snapshot(tmp_path):
    rec, returned = _train(tmp_path, _convert(_Gated(), "tensorwise"), _gated_batch, _gated_loss, fp8_every=1)
    assert _fp8_names(rec) == [] and returned == [None] * 4
    fp8 = load_run(tmp_path).fp8.collect()
    zero = fp8.filter((pl.col("step") == 2) & (pl.col("module") == "b") & (pl.col("role") == "input"))
    assert zero["nonzero"].to_list() == [0] and zero["flushed"].to_list() == [0]  # measured: all zeros, none lost
    # torchao clamps amax at 1e-12: the scale is finite (448 / 1e-12), nothing saturates
    assert zero["scale_max"][0] == pytest.approx(448 / 1e-12, rel=1e-6)


def test_fp8_every_measures_every_nth_step_and_leaves_no_hook_on_the_others(tmp_path):
    model = _convert(sm.build(False), "tensorwise")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hooked = []
    # layer_every=2: step 3's counts come to the host without the layer row's stack (CPU: value by value)
    with Recorder(tmp_path, model, optimizer=opt, fp8_every=3, layer_every=2, **REFS) as rec:
        for step in range(7):
            b = sm.batch(step)
            rec.begin_step(step, b)
            hooked.append(len(model.block.mlp.w2._forward_hooks))
            loss = sm.lm_loss(model, b)
            loss.backward()
            rec.end_step(loss)
            assert not model.block.mlp.w2._forward_hooks  # removed once the step's counts are taken
            opt.step()
            opt.zero_grad()
    assert hooked == [1, 0, 0, 1, 0, 0, 1]
    steps = load_run(tmp_path).fp8.select(pl.col("step").unique().sort()).collect()["step"].to_list()
    assert steps == [0, 3, 6]
    w = load_run(tmp_path).fp8.filter(pl.col("role") == "weight").group_by("module").agg(
        pl.col("numel").unique(), pl.col("amax").min()).collect()
    assert all(len(n) == 1 for n in w["numel"]) and (w["amax"] > 0).all()  # every step read back in its place
    assert sorted(n[0] for n in w["numel"]) == [32 * 32, 32 * 64, 32 * 64, 32 * 64, 32 * 64, 32 * 96]
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["fp8"]["every"] == 3 and meta["fp8"]["modules"][0] == "block.mlp.w1"
    assert meta["fp8_recipe"]["configs"][0]["roles"]["input"]["granularity"] == "tensorwise"


def test_fp8_every_none_records_no_fp8_rows_but_keeps_the_recipe(tmp_path):
    rec, _ = _swiglu(tmp_path, fp8_every=None)
    assert _fp8_names(rec) == [] and load_run(tmp_path).fp8 is None
    assert json.loads((tmp_path / "meta.json").read_text())["fp8_recipe"]["library"] == "torchao"


def test_a_model_without_fp8_modules_writes_no_fp8_entries(tmp_path):
    _train(tmp_path, _Gated(), _gated_batch, _gated_loss, steps=2, fp8_every=1)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["fp8"] is None and meta["fp8_recipe"] is None and load_run(tmp_path).fp8 is None


def test_the_report_names_the_cast_and_its_steps_and_is_silent_on_a_healthy_run(tmp_path):
    _swiglu(tmp_path / "bad", fp8_every=2)
    _swiglu(tmp_path / "ok", aligned=False, fp8_every=2)
    bad = CliRunner().invoke(cli, ["report", str(tmp_path / "bad"), "--json"])
    assert bad.exit_code == 0, bad.output
    (f,) = [f for f in json.loads(bad.output)["findings"] if f["check"] == "fp8_casts"]
    ev = f["evidence"]
    assert (ev["module"], ev["role"], ev["use"], ev["first_step"], ev["last_step"]) == (
        "block.mlp.w2", "input", "forward", 0, 2)
    assert ev["steps_over"] == ev["steps_measured"] == 2 and ev["max_flushed_frac"] > 0.5
    text = CliRunner().invoke(cli, ["report", str(tmp_path / "bad")]).output
    assert "fp8_casts @ step 0: block.mlp.w2 input (forward GEMM, e4m3 tensorwise)" in text
    assert "rowwise scaling or keeping this module in BF16" in text  # a tensorwise cast: rowwise is the way out
    n = len(json.loads((tmp_path / "bad" / "meta.json").read_text())["fp8_recipe"]["modules"])
    assert f"FP8 matmuls in {n} module(s) (tensorwise)" in text.splitlines()[0]  # the header names the FP8 run
    ok = CliRunner().invoke(cli, ["report", str(tmp_path / "ok"), "--json"])
    assert ok.exit_code == 0 and not [f for f in json.loads(ok.output)["findings"] if f["check"] == "fp8_casts"]


def test_a_run_of_format_7_without_fp8_parts_or_keys_still_reads(tmp_path):
    _train(tmp_path, _Gated(), _gated_batch, _gated_loss, steps=3)
    meta = json.loads((tmp_path / "meta.json").read_text())
    for k in ("fp8", "fp8_recipe"):
        del meta[k]
    meta["format_version"] = 7
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    run = load_run(tmp_path)
    assert run.fp8 is None and run.steps.collect().height == 3
    out = CliRunner().invoke(cli, ["report", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output


@pytest.mark.compile
def test_a_compiled_fp8_model_is_measured_on_its_sampled_steps(tmp_path):
    model = _convert(sm.build(True), "tensorwise")
    compiled = torch.compile(model, backend="aot_eager")  # the hooks' graph breaks; Inductor measured alike (docs)
    rec, returned = _train(tmp_path, compiled, sm.batch, sm.lm_loss, steps=3, fp8_every=2, **REFS)
    assert _fp8_names(rec) == [schema.snapshot_name(0, 0, schema.FP8)] and returned == [None] * 3
    fp8 = load_run(tmp_path).fp8.collect()
    assert sorted(fp8["step"].unique().to_list()) == [0, 2] and fp8.height == 2 * 6 * 3
    assert json.loads((tmp_path / "meta.json").read_text())["fp8"]["modules"][2] == "block.mlp.w2"  # no _orig_mod.


def test_a_sampled_step_that_raised_before_end_step_leaves_no_counts_to_the_next_step(tmp_path):
    model = _convert(sm.build(False), "tensorwise")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecorderWarning)  # end_step_missing: the loop skipped step 0's end_step
        with Recorder(tmp_path, model, optimizer=opt, fp8_every=2, **REFS) as rec:
            for step in range(2):
                b = sm.batch(step)
                rec.begin_step(step, b)
                loss = sm.lm_loss(model, b)
                loss.backward()
                if step == 0:  # a loop that skips a step it cannot finish (an OOM caught, a bad batch)
                    opt.zero_grad()
                    continue
                rec.end_step(loss)
    assert load_run(tmp_path).fp8 is None  # step 1 was no sampled step: it measured nothing, nor inherited step 0's


def test_accumulated_micro_batches_are_measured_call_by_call(tmp_path):
    model = _convert(sm.build(True), "tensorwise")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Recorder(tmp_path, model, optimizer=opt, fp8_every=1, micro_batches=2, **REFS) as rec:
        for step in range(2):
            micro = [sm.batch(2 * step), sm.batch(2 * step + 1)]
            rec.begin_step(step, micro)
            total = 0.0
            for b in micro:
                loss = sm.lm_loss(model, b) / 2
                loss.backward()
                total += loss.detach()
            rec.end_step(total)
            opt.step()
            opt.zero_grad()
    fp8 = load_run(tmp_path).fp8.collect()
    assert fp8.height == 2 * 2 * 6 * 3  # steps x micro-batches x Linears x roles
    w2 = fp8.filter((pl.col("module") == "block.mlp.w2") & (pl.col("role") == "input") & (pl.col("step") == 0))
    assert w2["call"].to_list() == [0, 1] and (w2["flushed"] / w2["nonzero"]).min() > schema.FP8_FLUSH_LIMIT
    assert load_snapshot(rec.snapshots[0]).fp8["fired"]["call"] in (0, 1)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_samples_tiny_gpt_trained_in_fp8_writes_no_fp8_snapshot_nor_finding(tmp_path, recipe):
    from samples import models as gpt
    from samples._common import gpt_batches

    cfg = gpt.GPTConfig()
    model = float8.convert_to_float8_training(gpt.build_gpt(), config=float8.Float8LinearConfig.from_recipe_name(recipe),
                                              module_filter_fn=lambda m, fqn: m.in_features % 16 == 0)
    it = gpt_batches(vocab_size=cfg.vocab_size, block_size=cfg.block_size, batch_size=8, seed=0)
    batches = [next(it) for _ in range(20)]
    rec, _ = _train(tmp_path, model, batches.__getitem__, gpt.gpt_loss, steps=20, fp8_every=5, amp_dtype=torch.bfloat16)
    fp8 = load_run(tmp_path).fp8.collect()
    assert _fp8_names(rec) == [] and fp8["step"].unique().sort().to_list() == [0, 5, 10, 15]
    # measured here: at most 0.03% of any cast's non-zero values flush, nothing saturates
    assert (fp8["flushed"] / fp8["nonzero"]).max() < schema.FP8_FLUSH_LIMIT / 10 and fp8["saturated"].sum() == 0
    out = CliRunner().invoke(cli, ["report", str(tmp_path), "--json"])
    assert out.exit_code == 0 and not [f for f in json.loads(out.output)["findings"] if f["check"] == "fp8_casts"]


def test_mxfp8_training_weights_are_measured_in_blocks_and_the_aligned_swiglu_fires_nothing(tmp_path):
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization import quantize_

    model = sm.build(True).to(torch.bfloat16)  # (torchao 0.18's emulated MXFP8 mm refuses CPU autocast's mixed dtypes)
    quantize_(model, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL),
              filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear))
    rec, _ = _train(tmp_path, model, sm.batch, sm.lm_loss, steps=2, fp8_every=1, **REFS)
    fp8 = load_run(tmp_path).fp8.collect()
    # every operand for both GEMMs that read it, in blocks of 32 along each GEMM's reduction dim
    assert fp8.height == 2 * 6 * 3 * 2 and set(fp8["granularity"]) == {"mxfp8"} and set(fp8["format"]) == {"e4m3"}
    # blocks of 32 isolate the rare token's outlier: w2's input flushes 1.5% (tensorwise: 98%)
    w2 = fp8.filter((pl.col("module") == "block.mlp.w2") & (pl.col("role") == "input"))
    assert (w2["flushed"] / w2["nonzero"]).max() < schema.FP8_FLUSH_LIMIT and _fp8_names(rec) == []


def test_a_snapshot_of_an_mxfp8_model_holds_plain_weights_that_load_with_weights_only(tmp_path):
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization import quantize_

    model = sm.build(True).to(torch.bfloat16)
    quantize_(model, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL),
              filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear))
    assert type(model.block.mlp.w2.weight).__name__ == "MXFP8TrainingWeightWrapperTensor"
    with Recorder(tmp_path, model, **REFS) as rec:
        b = sm.batch(0)
        rec.begin_step(0, b)
        sm.lm_loss(model, b).backward()
        path = rec.snapshot("manual")
        rec.end_step(torch.tensor(1.0))
    state = torch.load(path, weights_only=True)["model_state"]  # torchao's wrapper class would be refused
    w = state["block.mlp.w2.weight"]
    assert type(w) is torch.Tensor and w.dtype == torch.bfloat16
    torch.testing.assert_close(w, model.block.mlp.w2.weight._data, rtol=0, atol=0)  # round trip: the same values


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the reads of tensor values into Python (item, tolist) inside its block."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.item, torch.Tensor.tolist):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _reads_per_step(run_dir, fp8_every) -> list[int]:
    model = _convert(sm.build(False), "tensorwise")  # healthy: no snapshot (whose writing reads values) is taken
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counts = []
    with Recorder(run_dir, model, optimizer=opt, fp8_every=fp8_every, flush_every=1000, **REFS) as rec:
        for step in range(3):
            b = sm.batch(step)
            with _HostReads() as mode:  # the whole step: the hooks' counts in forward and backward, end_step
                rec.begin_step(step, b)
                loss = sm.lm_loss(model, b)
                loss.backward()
                rec.end_step(loss)
            counts.append(mode.n)
            opt.step()
            opt.zero_grad()
    return counts


def test_the_fp8_counts_add_no_host_read_they_join_the_steps_one_transfer(tmp_path):
    on, off = _reads_per_step(tmp_path / "on", 1), _reads_per_step(tmp_path / "off", None)
    assert load_run(tmp_path / "on").fp8.collect().height == 3 * 6 * 3  # measured on every step
    assert on == off and min(on) >= 1  # the step's own read is seen, and no other


def test_a_failing_step_whose_cast_fires_is_snapshotted_as_the_failure_with_the_fp8_evidence(tmp_path):
    model = _convert(sm.build(True), "tensorwise")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Recorder(tmp_path, model, optimizer=opt, fp8_every=1, **REFS) as rec:
        for step in range(2):
            b = sm.batch(step)
            rec.begin_step(step, b)
            loss = sm.lm_loss(model, b)
            loss.backward()
            rec.end_step(float("nan") if step == 0 else loss)  # step 0 fails (the loop reports a NaN loss)
            opt.step()
            opt.zero_grad()
    assert [p.name for p in rec.snapshots] == [schema.snapshot_name(0, 0, schema.NONFINITE_LOSS)]
    fired = load_snapshot(rec.snapshots[0]).fp8["fired"]
    assert (fired["module"], fired["role"]) == ("block.mlp.w2", "input")
    assert rec._fp8.fired == 0  # the failure took the step: no fp8 snapshot spent

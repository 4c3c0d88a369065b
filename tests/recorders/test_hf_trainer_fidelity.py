"""The HF callback records a real Trainer run as HF itself reports it: its step numbers, its
pre-clip gradient norm, its loss under accumulation (tiny Llama, BF16, learning_rate=1e5)."""
from __future__ import annotations

import json
import math

import polars as pl
import pytest

from recorders import schema
from recorders.recorder import RecorderWarning
from tests.hf_runs import first_nonfinite_grad_step, logged_steps
from tests.extras import require


def _steps(run: dict) -> pl.DataFrame:
    return pl.read_parquet(run["run_dir"] / schema.TRACE_DIR / schema.STEPS_GLOB).sort("step")


def test_recorded_steps_carry_hf_global_step_numbers(hf_blowup_run):
    steps = _steps(hf_blowup_run)
    # HF logs an optimizer step under the global_step it ends with: 1, 2, ...; so does the trace
    assert steps["step"].to_list() == [e["step"] for e in logged_steps(hf_blowup_run)] == [1, 2, 3, 4, 5, 6]


def test_the_first_nonfinite_gradient_step_is_the_one_hf_logs_and_is_snapshotted_under_it(hf_blowup_run):
    steps = _steps(hf_blowup_run)
    hf_step = first_nonfinite_grad_step(hf_blowup_run)
    assert hf_step is not None and hf_step > 1  # the blow-up needs one update first
    recorded = steps.filter(pl.col("nonfinite_grads") > 0)["step"][0]
    assert recorded == hf_step
    snap = hf_blowup_run["run_dir"] / schema.SNAPSHOT_DIR / schema.snapshot_name(hf_step, 0, "nonfinite_grads")
    assert snap in hf_blowup_run["callback"].recorder.snapshots


def test_the_step_one_gradient_norm_is_hfs_pre_clip_norm(hf_blowup_run):
    hf = logged_steps(hf_blowup_run)[0]
    assert hf["grad_norm"] > 1.0  # above max_grad_norm=1.0: HF clipped this step, so a post-clip read shows 1.0
    assert _steps(hf_blowup_run)["grad_norm"][0] == pytest.approx(hf["grad_norm"], rel=0.02)


@pytest.mark.parametrize("fixture", ["hf_blowup_run", "hf_blowup_accum_run"])
def test_the_recorded_loss_is_the_loss_hf_logs_for_the_step(fixture, request):
    run = request.getfixturevalue(fixture)
    steps = _steps(run)
    for e in logged_steps(run):
        if math.isfinite(e["grad_norm"]):  # at a NaN step HF's logging_nan_inf_filter logs a stand-in
            rec = steps.filter(pl.col("step") == e["step"])["loss"][0]
            assert rec == pytest.approx(e["loss"], abs=1e-4), e  # HF rounds logged losses to 4 decimals


def test_accumulated_steps_record_the_whole_steps_gradient_norm(hf_blowup_accum_run):
    hf = logged_steps(hf_blowup_accum_run)[0]
    assert _steps(hf_blowup_accum_run)["grad_norm"][0] == pytest.approx(hf["grad_norm"], rel=0.02)
    assert first_nonfinite_grad_step(hf_blowup_accum_run) == \
        _steps(hf_blowup_accum_run).filter(pl.col("nonfinite_grads") > 0)["step"][0]


def test_meta_json_names_hf_numbering_and_the_micro_batch_count(hf_blowup_run, hf_blowup_accum_run):
    for run, micro in ((hf_blowup_run, 1), (hf_blowup_accum_run, 2)):
        meta = json.loads((run["run_dir"] / schema.META_FILE).read_text())
        assert meta["format_version"] == schema.FORMAT_VERSION >= 4
        assert meta["step_numbering"] == "hf_trainer" and meta["micro_batches"] == micro


def test_accumulation_keeps_every_micro_batch_without_a_warning(hf_blowup_run, hf_blowup_accum_run):
    for run in (hf_blowup_run, hf_blowup_accum_run):
        assert not [w for w in run["warnings"] if "gradient_accumulation_steps" in str(w.message)]
    kept = [json.loads((run["run_dir"] / schema.META_FILE).read_text())["micro_batches_kept"]
            for run in (hf_blowup_run, hf_blowup_accum_run)]
    assert kept == [None, True]  # no accumulation: nothing to keep; with it, every snapshot holds all


def test_no_post_clip_warning_when_the_backward_runs_through_the_models_loss(hf_blowup_run):
    assert not [w for w in hf_blowup_run["warnings"] if "post-clip" in str(w.message)]


def test_a_compute_loss_outside_the_models_loss_records_post_clip_norms_and_says_so(tmp_path):
    require("transformers", "hf")
    import torch.nn.functional as F
    from transformers import Trainer

    from tests.hf_runs import train_hf

    class LogitsLoss(Trainer):
        """A custom compute_loss: the model gets no labels, so its output carries no loss."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            logits = model(**inputs).logits
            return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())

    run = train_hf(tmp_path, steps=1, trainer_cls=LogitsLoss)
    [w] = [w for w in run["warnings"] if "post-clip" in str(w.message)]
    assert w.category is RecorderWarning
    # kept in meta.json like the Recorder's own warnings, under the HF step it is about, and repeated by report
    meta = json.loads((run["run_dir"] / schema.META_FILE).read_text())
    assert meta["warnings"] == [{"kind": "grads_post_clip", "step": 1, "message": str(w.message)}]
    from analyzer.report import build_report

    [f] = [f for f in build_report(run["run_dir"]).findings if f.check == "recorder_warning"]
    assert (f.evidence["kind"], f.step) == ("grads_post_clip", 1) and "post-clip" in f.message
    hf = logged_steps(run)[0]["grad_norm"]
    recorded = _steps(run)["grad_norm"][0]
    assert hf > 1.0 and recorded == pytest.approx(1.0, rel=1e-3)  # clipped to max_grad_norm: the warning is true


def test_a_model_called_with_positional_inputs_is_warned_once_and_the_warning_is_kept(tmp_path):
    require("transformers", "hf")
    from transformers import Trainer

    from tests.hf_runs import train_hf

    class Positional(Trainer):
        """A custom compute_loss that passes input_ids positionally: the recorded batch cannot hold them."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(inputs["input_ids"], labels=inputs["labels"]).loss

    run = train_hf(tmp_path, steps=2, trainer_cls=Positional)
    [w] = [w for w in run["warnings"] if "positional inputs" in str(w.message)]
    assert w.category is RecorderWarning
    meta = json.loads((run["run_dir"] / schema.META_FILE).read_text())
    kept = [e for e in meta["warnings"] if e["kind"] == "positional_inputs"]
    assert kept == [{"kind": "positional_inputs", "step": 1, "message": str(w.message)}]  # HF's first step is 1

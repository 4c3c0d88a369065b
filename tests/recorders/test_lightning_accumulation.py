"""Lightning with ``accumulate_grad_batches=2`` (BF16, CPU): a NaN in the *second* micro-batch of
step 2. The callback keeps both micro-batches of the step and records its real loss; the report
blames neither backward nor the loss, and the replay names the NaN input in micro-batch 1 (0-based)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import polars as pl
import pytest
import torch
import torch.nn.functional as F

from recorders import schema
from tests.extras import require

L = require("lightning", "lightning")

from tests.recorders.test_integrations_lightning import WIDTH, TinyRegressor  # noqa: E402

MICRO, BATCH, STEPS = 2, 2, 4
NAN_STEP = 2
ROOT = Path(__file__).resolve().parents[2]


def _data():
    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(WIDTH, generator=g), "y": torch.randn(1, generator=g)} for _ in range(STEPS * MICRO * BATCH)]
    data[(NAN_STEP * MICRO + 1) * BATCH + 1]["x"][2] = float("nan")  # step 2's second micro-batch
    return data


@pytest.fixture(scope="module")
def accum_run(tmp_path_factory):
    from lightning.pytorch.loggers import CSVLogger

    from recorders.integrations.lightning import AmpAutopsyCallback

    root = tmp_path_factory.mktemp("pl_accum")
    cb = AmpAutopsyCallback(root / "run")
    loader = torch.utils.data.DataLoader(_data(), batch_size=BATCH, shuffle=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, precision="bf16-mixed",
                            accumulate_grad_batches=MICRO, logger=CSVLogger(root / "logs"), log_every_n_steps=1,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[cb])
        trainer.fit(TinyRegressor(), loader)
    return {"run_dir": root / "run", "logs": root / "logs", "warnings": caught}


def _steps(run_dir) -> pl.DataFrame:
    return pl.read_parquet(run_dir / schema.TRACE_DIR / schema.STEPS_GLOB).sort("step")


def test_accumulation_keeps_both_micro_batches_without_a_warning(accum_run):
    assert not [w for w in accum_run["warnings"] if "accumulate_grad_batches" in str(w.message)]
    meta = json.loads((accum_run["run_dir"] / schema.META_FILE).read_text())
    assert meta["micro_batches"] == MICRO and meta["step_numbering"] == "lightning"
    assert meta["micro_batches_kept"] is True
    snap = torch.load(accum_run["run_dir"] / schema.SNAPSHOT_DIR / schema.snapshot_name(NAN_STEP, 0, "nonfinite_loss"),
                      weights_only=True)
    assert [bool(torch.isnan(mb["x"]).any()) for mb in snap["batch"]] == [False, True]
    assert snap["micro_batches"] == {"count": MICRO, "combine": "mean", "divisor": float(MICRO),
                                     "source": "lightning", "num_items_in_batch": None}


def test_replay_names_the_nan_input_in_micro_batch_1(accum_run):
    from analyzer.replay import replay_snapshot

    snap = accum_run["run_dir"] / schema.SNAPSHOT_DIR / schema.snapshot_name(NAN_STEP, 0, "nonfinite_loss")
    r = replay_snapshot(snap, device="cpu")
    assert r.verdict == "nonfinite_input" and r.nonfinite_inputs == ["batch:1.x"]
    assert r.culprit["micro_batch"] == 1 and "micro-batch 1 (0-based) of the 2" in r.summary


def test_the_recorded_loss_is_the_mean_over_the_steps_micro_batches(accum_run):
    steps = _steps(accum_run["run_dir"])
    assert steps["step"].to_list() == list(range(STEPS))
    model, data = TinyRegressor(), _data()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [F.mse_loss(model.net(torch.stack([d["x"] for d in data[i:i + BATCH]])),
                             torch.stack([d["y"] for d in data[i:i + BATCH]])).item() for i in (0, BATCH)]
    assert steps["loss"][0] == pytest.approx(sum(losses) / MICRO, rel=1e-3)  # not the first micro-batch's alone
    assert math.isnan(steps["loss"][NAN_STEP])  # the NaN micro-batch is the second: the step's loss shows it


def test_the_report_makes_no_backward_or_loss_claim_about_the_unrecorded_micro_batch(accum_run):
    from analyzer.report import build_report

    rep = build_report(accum_run["run_dir"])
    errors = [f for f in rep.findings if f.severity == "error"]
    assert errors and errors[0].step == NAN_STEP
    text = " ".join(f.message for f in rep.findings)
    assert "backward or in the loss" not in text
    assert "snapshot holds them all" in text and "holds the first only" not in text


@pytest.mark.slow
def test_the_autopsy_heads_its_answer_with_the_nan_input_of_micro_batch_1(accum_run):
    from analyzer.autopsy import run_autopsy
    from analyzer.autopsy.answer import answer_lines

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_autopsy(accum_run["run_dir"], device="cpu")
    lines = answer_lines(result)
    assert "backward or in the loss" not in "\n".join(lines)
    assert lines[0].startswith("root cause: nonfinite_input: batch:1.x")
    assert "micro-batch 1 (0-based)" in lines[0]


@pytest.mark.slow
def test_a_replay_of_the_lightning_snapshot_prints_no_self_log_warning(accum_run):
    snap = accum_run["run_dir"] / schema.SNAPSHOT_DIR / schema.snapshot_name(NAN_STEP, 0, "nonfinite_loss")
    out = subprocess.run([sys.executable, "-c", "from analyzer.cli import main; main()", "replay", str(snap),
                          "--device", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "verdict" in out.stdout.lower()
    assert "self.log" not in out.stdout + out.stderr


def test_lightnings_own_metrics_csv_gets_no_precision_range_claim(accum_run):
    from analyzer.report import build_report

    [csv] = list(accum_run["logs"].rglob("metrics.csv"))
    rep = build_report(accum_run["logs"])
    assert rep.source_format == "lightning_csv" and Path(rep.run) == accum_run["logs"]
    [f] = [f for f in rep.findings if f.check == "nonfinite_loss"]
    assert f.step == NAN_STEP
    for claim in ("not a precision range issue", "not a range issue", "in FP32", "in BF16"):
        assert claim not in f.message
    assert "does not say which precision ran" in f.message
    assert csv.exists()


def test_a_healthy_accumulated_step_replays_to_the_gradients_lightning_summed(tmp_path):
    from analyzer.replay import Replay
    from analyzer.replay.runs._runs import run_once
    from recorders.integrations.lightning import AmpAutopsyCallback

    class Grab(L.Callback):
        """Before optimizer step 1 (after the recorder's end_step): a manual snapshot and Lightning's gradients."""

        def __init__(self, cb):
            self.cb, self.grads = cb, None

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 1:
                self.cb.recorder.snapshot()
                self.grads = {n: p.grad.clone() for n, p in pl_module.named_parameters()}

    data = [d for d in _data() if torch.isfinite(d["x"]).all()]
    cb = AmpAutopsyCallback(tmp_path / "run")
    grab = Grab(cb)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, precision="32-true",
                            accumulate_grad_batches=MICRO, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, grab])
        trainer.fit(TinyRegressor(), loader)
    assert grab.grads, "the step was not grabbed"
    [path] = (tmp_path / "run" / schema.SNAPSHOT_DIR).glob("*-manual.pt")
    replay = Replay(path, device="cpu")
    assert replay.run().verdict == "healthy"
    ctx = replay.context()
    run_once(ctx, "float32", 1.0)
    got = dict(ctx._model.named_parameters())  # run_once leaves the accumulated gradients there
    for name, want in grab.grads.items():
        torch.testing.assert_close(got[name].grad, want, rtol=1e-5, atol=1e-7)

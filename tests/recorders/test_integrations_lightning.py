"""The Lightning adapter drives a real ``lightning.Trainer`` on CPU, in BF16 and in FP16 with a GradScaler."""
from __future__ import annotations

import json
import math
import warnings

import polars as pl
import pytest
import torch
import torch.nn.functional as F

from recorders import schema
from tests.extras import require

L = require("lightning", "lightning")

NAN_STEP = 2
BATCH = 4
STEPS = 4
WIDTH = 8


class TinyRegressor(L.LightningModule):
    """Two linear layers; rebuilt offline as ``TinyRegressor(**hparams)``."""

    def __init__(self, width: int = WIDTH, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        g = torch.Generator().manual_seed(0)  # private generator: building draws no global RNG
        self.net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.net(batch["x"]), batch["y"])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _loader():
    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(WIDTH, generator=g), "y": torch.randn(1, generator=g)} for _ in range(STEPS * BATCH)]
    data[NAN_STEP * BATCH + 1]["x"][2] = float("nan")
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)  # the NaN lands in step NAN_STEP


def _fit(run_dir, *, precision=None, plugins=None, **callback_kwargs):
    from recorders.integrations.lightning import AmpAutopsyCallback

    cb = AmpAutopsyCallback(run_dir, **callback_kwargs)
    extra = {"precision": precision} if precision else {}
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(run_dir.parent),
        plugins=plugins or [], callbacks=[cb], **extra,
    )
    trainer.fit(TinyRegressor(), _loader())
    return cb


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pl_bf16") / "run"
    return run_dir, _fit(run_dir, precision="bf16-mixed")


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    from lightning.pytorch.plugins import MixedPrecision

    run_dir = tmp_path_factory.mktemp("pl_fp16") / "run"
    # init_scale 1024: at the default 65536 this model's FP16 backward overflows at once (the scale
    # exceeds FP16's max), which would hide the NaN step among loss-scale skips.
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    return run_dir, _fit(run_dir, plugins=[plugin])


def _steps(run_dir) -> pl.DataFrame:
    return pl.read_parquet(run_dir / schema.TRACE_DIR / schema.STEPS_GLOB).sort("step")


def _snapshot_path(run_dir):
    return run_dir / schema.SNAPSHOT_DIR / schema.snapshot_name(NAN_STEP, 0, "nonfinite_loss")


def test_a_bf16_lightning_run_records_every_step_and_snapshots_the_nan_batch(bf16_run):
    run_dir, cb = bf16_run
    steps = _steps(run_dir)
    assert steps["step"].to_list() == list(range(STEPS))  # trainer.global_step at each step's start
    assert math.isnan(steps["loss"][NAN_STEP]) and math.isfinite(steps["loss"][NAN_STEP - 1])
    meta = json.loads((run_dir / schema.META_FILE).read_text())
    assert meta["amp_dtype"] == "bfloat16" and meta["scaler"] is None
    assert meta["step_numbering"] == "lightning" and meta["micro_batches"] == 1
    assert meta["factory"] == "recorders.integrations.lightning:build_module"
    assert meta["factory_kwargs"] == {"module_class": f"{__name__}:TinyRegressor",
                                      "hparams": {"width": WIDTH, "lr": 0.05}}
    assert cb.recorder.snapshots == [_snapshot_path(run_dir)]
    assert cb.recorder.closed  # on_train_end closed it


def test_the_lightning_snapshot_holds_the_failing_batch_and_the_pre_step_weights(bf16_run):
    from analyzer.load import load_snapshot

    run_dir, _ = bf16_run
    snap = load_snapshot(_snapshot_path(run_dir))
    assert snap["step"] == NAN_STEP and snap["amp_dtype"] == "bfloat16"
    assert torch.isnan(snap["batch"]["x"][1, 2]) and torch.isnan(snap["batch"]["x"]).sum() == 1
    assert all(torch.isfinite(t).all() for t in snap["model_state"].values())


def test_the_snapshot_rebuilds_the_module_from_its_hparams_and_reproduces_the_nan(bf16_run):
    from recorders.integrations.lightning import build_module, training_step_loss

    run_dir, _ = bf16_run
    snap = torch.load(_snapshot_path(run_dir), weights_only=True)
    model = build_module(**snap["factory_kwargs"])
    model.load_state_dict(snap["model_state"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = training_step_loss(model, snap["batch"])
    assert torch.isnan(loss)
    # training_step calls self.log, which outside a Trainer warns: training_step_loss silences it
    assert not [w for w in caught if "self.log" in str(w.message)]


def test_replay_of_the_lightning_snapshot_blames_the_nan_in_the_batch_without_a_self_log_warning(bf16_run):
    from analyzer.replay import replay_snapshot

    run_dir, _ = bf16_run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = replay_snapshot(str(_snapshot_path(run_dir)), device="cpu").to_dict()
    assert not [w for w in caught if "self.log" in str(w.message)]
    assert result["verdict"] == "nonfinite_input"
    assert result["culprit"]["input"] == "batch:x"  # the replay names the batch leaf, not a weight


def test_fp16_with_a_grad_scaler_records_the_skip_and_the_scale_backoff(fp16_run):
    run_dir, _ = fp16_run
    steps = _steps(run_dir)
    # The NaN step is skipped and the scale halves after it (growth needs 2000 clean steps).
    assert steps["scale"].to_list() == [1024.0, 1024.0, 1024.0, 512.0]
    assert steps["skipped"].to_list() == [False, False, True, False]
    assert math.isnan(steps["loss"][NAN_STEP])
    meta = json.loads((run_dir / schema.META_FILE).read_text())
    assert meta["amp_dtype"] == "float16" and meta["scaler"]["init_scale"] == 1024.0


def test_fp16_loss_and_grad_norm_are_recorded_unscaled_although_lightning_unscales_first(fp16_run):
    run_dir, _ = fp16_run
    steps = _steps(run_dir)
    # Recompute step 0 by hand: same initial weights, first batch, FP16 autocast, no scaling.
    model = TinyRegressor()
    batch = next(iter(_loader()))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model.net(batch["x"]), batch["y"])
    loss.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    # Lightning hands the callback scale * loss and unscales the grads before on_before_optimizer_step;
    # a factor of 1024 either way would show here.
    assert steps["loss"][0] == pytest.approx(loss.item(), rel=1e-3)
    assert steps["grad_norm"][0] == pytest.approx(grad_norm.item(), rel=1e-2)


def test_fp16_16_mixed_on_a_cpu_trainer_becomes_bf16_with_no_scaler(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.warns(UserWarning, match="not supported on CPU"):
        _fit(run_dir, precision="16-mixed")
    meta = json.loads((run_dir / schema.META_FILE).read_text())
    assert meta["amp_dtype"] == "bfloat16" and meta["scaler"] is None

"""``cancel_models.Regressor`` as a LightningModule, trained by a real ``lightning.Trainer`` in BF16.

Importable as ``tests.analyzer.replay.cancel_lightning:LitRegressor``, the class the Lightning
callback stores (``module_class``) and replay rebuilds from its hyperparameters.
"""
from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from tests.analyzer.replay import cancel_models as cm


class LitRegressor(L.LightningModule):
    def __init__(self, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.model = cm.build()

    def training_step(self, batch, batch_idx):
        loss = cm.loss(self.model, batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _loader():
    rows = []
    for step in range(cm.FAIL_STEP + 1):
        b = cm.batch_at(step)
        rows += [{"x": b["x"][i], "y": b["y"][i]} for i in range(cm.BATCH)]
    return torch.utils.data.DataLoader(rows, batch_size=cm.BATCH, shuffle=False)  # step k is batch_at(k)


def fit(run_dir: Path) -> Path:
    """Train under Lightning with the amp-autopsy callback; returns the failing step's snapshot."""
    from recorders.integrations.lightning import AmpAutopsyCallback

    cb = AmpAutopsyCallback(run_dir)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=cm.FAIL_STEP + 1, precision="bf16-mixed",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(run_dir.parent), callbacks=[cb])
    trainer.fit(LitRegressor(), _loader())
    snaps = sorted((run_dir / "snapshots").glob("*.pt"))
    assert snaps, "the Lightning run wrote no snapshot"
    return snaps[0]

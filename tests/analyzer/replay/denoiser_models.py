"""A small diffusion-style denoiser whose loss draws its own noise level: a failure that lives in a random draw.

The loss function draws the noise level σ log-normally itself (as EDM-style training does), casts σ
to the prediction's dtype and weights the error by ``1 / σ**2``. In FP16 that weight overflows
(``1 / σ**2 > 65504``) whenever σ < 0.0039, so an FP16 run dies at the first such draw, whatever
the weights; FP32 and BF16 hold the weight. Only the step's RNG state says which σ the failing step drew.

``train_until_nonfinite`` trains it without any recorder, the way a user's loop does, and saves what
the README's "After a crash" says: the weights, and the failing step's batch with the RNG state taken at
the step's start. References for replay: ``REF + ":build_denoiser"`` and ``REF + ":denoiser_loss"``.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

__all__ = ["REF", "P_MEAN", "P_STD", "WIDTH", "build_denoiser", "denoiser_loss", "make_batch", "train_until_nonfinite",
           "train_recorded"]

REF = "tests.analyzer.replay.denoiser_models"
P_MEAN, P_STD = -1.2, 1.6  # log σ ~ N(P_MEAN, P_STD): σ < 0.0039 (log σ < -5.55) for ~0.3% of the samples
WIDTH = 8


def build_denoiser(width: int = WIDTH, hidden: int = 32, seed: int = 0) -> nn.Module:
    """An MLP that maps a noised sample to the clean one; weights from a private generator (no global draw)."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, hidden), nn.SiLU(), nn.Linear(hidden, width))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def denoiser_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """σ-weighted denoising loss: σ drawn here, cast to the prediction's dtype, weighted by 1/σ²."""
    x = batch["x"]
    sigma = (torch.randn(x.shape[0], 1, device=x.device) * P_STD + P_MEAN).exp()
    noise = torch.randn_like(x)
    pred = model(x + sigma * noise)
    sigma = sigma.to(pred.dtype)  # the cast that makes the weight FP16 under autocast
    weight = 1 / sigma ** 2  # FP16: inf for sigma < 0.0039
    return (weight * (pred - x) ** 2).mean()


def make_batch(step: int, size: int = 16, width: int = WIDTH) -> dict:
    """The data of `step`, from its own generator: the global RNG is the loss's alone."""
    g = torch.Generator().manual_seed(1000 + step)
    return {"x": torch.randn(size, width, generator=g)}


def train_until_nonfinite(out: Path, *, steps: int = 400, save_rng: str = "batch") -> dict:
    """FP16 autocast with ``GradScaler("cpu")``, no recorder, until the loss is not finite; then save the
    checkpoint (weights and scaler state) and the batch as the README says.

    `save_rng`: ``"batch"`` saves ``{"batch": batch, "rng": rng}`` as batch.pt; ``"file"`` saves the batch
    alone and the RNG state as rng.pt; ``"none"`` saves the batch alone (no RNG state).

    Returns ``{"step", "loss", "checkpoint", "batch", "rng" (a path or None)}``.
    """
    torch.manual_seed(0)
    model = build_denoiser()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    out.mkdir(parents=True, exist_ok=True)
    for step in range(steps):
        batch = make_batch(step)
        rng = {"cpu": torch.get_rng_state(), "cuda": None}  # the step's start: before the loss draws σ
        with torch.autocast("cpu", dtype=torch.float16):
            loss = denoiser_loss(model, batch)
        if not torch.isfinite(loss):
            torch.save({"model": model.state_dict(), "scaler": scaler.state_dict(), "step": step},
                       out / "ckpt.pt")
            rng_path = None
            if save_rng == "batch":
                torch.save({"batch": batch, "rng": rng}, out / "batch.pt")
            else:
                torch.save(batch, out / "batch.pt")
            if save_rng == "file":
                rng_path = out / "rng.pt"
                torch.save(rng, rng_path)
            return {"step": step, "loss": float(loss.detach()), "checkpoint": out / "ckpt.pt", "batch": out / "batch.pt",
                    "rng": rng_path}
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    raise AssertionError(f"the denoiser trained {steps} steps without a non-finite loss")


def train_recorded(run_dir: Path, *, steps: int = 400) -> Path:
    """The same loop as ``train_until_nonfinite`` (FP16 autocast, ``GradScaler("cpu")`` at its default init_scale)
    with the Recorder, as the README's loop has it, until the recorder sees a non-finite loss.

    Returns the ``nonfinite_loss`` snapshot the recorder wrote for that step.
    """
    from recorders import Recorder

    torch.manual_seed(0)
    model = build_denoiser()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with Recorder(run_dir, model, factory=f"{REF}:build_denoiser", loss_fn=f"{REF}:denoiser_loss", scaler=scaler,
                  amp_dtype=torch.float16, optimizer=opt) as rec:
        for step in range(steps):
            batch = make_batch(step)
            rec.begin_step(step, batch)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = denoiser_loss(model, batch)
            scaler.scale(loss).backward()
            rec.end_step(loss)
            if not torch.isfinite(loss):
                break
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    snaps = [p for p in rec.snapshots if p.name.endswith("-nonfinite_loss.pt")]
    if not snaps:
        raise AssertionError(f"the recorded denoiser wrote no nonfinite_loss snapshot in {steps} steps")
    return snaps[0]

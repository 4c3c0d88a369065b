"""Test material for ``analyzer report``: scripted traces written as real run directories, and
tiny real models trained with the real Recorder (importable by reference for snapshots)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import torch
import torch.nn.functional as F
from torch import nn

from recorders import schema

__all__ = ["Script", "make_meta", "build_attn", "attn_loss", "build_sigmoid_mlp", "mlp_loss",
           "build_small_mlp", "build_sqrt_norm", "build_regression", "mse_loss", "weighted_mlp_loss",
           "batches", "train_recorded"]


# --------------------------------------------------------------------------- scripted traces
@dataclass
class Script:
    """A healthy-looking FP16 trace with realistic noise, to be mutated by a test and written.

    - loss decays from ~4 to ~1 with 3% multiplicative noise and a few 10% bumps;
    - GradScaler behaviour is simulated: scale 65536 overflows at the start (the scaled
      gradient passes the "safe" scale ~20000, so 2 skips), then the scale doubles after
      `growth_interval` clean steps and overflows back: ~1 skip per growth interval;
    - per-parameter gradient norms around 10^-1.5 (+-0.3 between layers, 0.1 step noise).
    """

    n: int = 400
    n_layers: int = 8
    amp_dtype: str | None = "float16"
    growth_interval: int = 100
    seed: int = 0
    rank: int = 0
    names: list[str] = field(default_factory=list)
    scaler: bool = True  # FP16 only: False records no scale (an FP16 run without a GradScaler)

    def __post_init__(self):
        rng = np.random.default_rng(self.seed + 1000 * self.rank)
        n, L = self.n, self.n_layers
        self.step = np.arange(n, dtype=np.int64)
        noise = rng.lognormal(0, 0.03, n) * np.where(rng.random(n) < 0.03, 1.1, 1.0)
        self.loss = (3 * np.exp(-self.step / 150) + 1) * noise
        self.loss_dtype = np.array(["float32"] * n, dtype=object)
        if not self.names:
            self.names = [f"blocks.{i // 2}.{'weight' if i % 2 == 0 else 'bias'}" for i in range(L)]
        base = rng.normal(-1.5, 0.3, L)
        self.lg = base[None, :] + rng.normal(0, 0.1, (n, L))
        self.zero_frac = np.full((n, L), 0.001)
        self.pnorm = np.tile(rng.uniform(1, 5, L), (n, 1))
        self.numels = [16] * L
        self.scale = np.full(n, np.nan)
        self.skipped = np.zeros(n, bool)
        self.nonfinite = None  # non-finite gradient elements per step (default: 10 on skipped steps)
        self.layer_nonfinite = np.zeros((n, L), np.int64)
        if self.amp_dtype == "float16" and self.scaler:
            s, clean = 65536.0, 0
            safe = 20000 * rng.lognormal(0, 0.05, n)
            for i in range(n):
                self.scale[i] = s
                if s > safe[i]:
                    self.skipped[i], s, clean = True, s / 2, 0
                else:
                    clean += 1
                    if clean == self.growth_interval:
                        s, clean = s * 2, 0

    def grad_norm(self) -> np.ndarray:
        return np.sqrt((10.0 ** (2 * self.lg)).sum(axis=1))

    def steps_frame(self) -> pl.DataFrame:
        fp16 = self.amp_dtype == "float16" and self.scaler
        nonfinite = np.where(self.skipped, 10, 0) if self.nonfinite is None else self.nonfinite
        return pl.DataFrame({
            "step": self.step, "rank": np.full(self.n, self.rank, np.int32),
            "wall_time": 1.7e9 + self.step * 0.1, "loss": self.loss,
            "loss_dtype": self.loss_dtype.astype(str),
            "scale": self.scale if fp16 else [None] * self.n,
            "skipped": self.skipped if fp16 else [None] * self.n,
            "grad_norm": self.grad_norm(), "lr": np.full(self.n, 1e-3),
            "nonfinite_grads": np.asarray(nonfinite).astype(np.int64),
        }, schema=schema.STEP_COLUMNS, strict=False)

    def layers_frame(self) -> pl.DataFrame:
        n, L = self.n, self.n_layers
        return pl.DataFrame({
            "step": np.repeat(self.step, L), "rank": np.full(n * L, self.rank, np.int32),
            "layer": np.tile(np.arange(L, dtype=np.int32), n),
            "grad_norm": (10.0 ** self.lg).ravel().astype(np.float32),
            "param_norm": self.pnorm.ravel().astype(np.float32),
            "grad_nonfinite": self.layer_nonfinite.ravel(),
            "grad_zero_frac": self.zero_frac.ravel().astype(np.float32),
            "update_rms": [None] * (n * L), "unchanged_frac": [None] * (n * L),  # version 3: not modelled
        }, schema=schema.LAYER_COLUMNS, strict=False)

    def meta(self, world_size: int = 1) -> dict:
        scaler = ({"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": self.growth_interval,
                   "init_scale": 65536.0} if self.amp_dtype == "float16" and self.scaler else None)
        params = [{"name": nm, "shape": [k], "numel": k, "dtype": "float32", "depth": i}
                  for i, (nm, k) in enumerate(zip(self.names, self.numels))]
        return make_meta(self.rank, world_size, self.amp_dtype, scaler, params)

    def write(self, run_dir: Path, *, parts: int = 2, world_size: int = 1, layers: bool = True) -> Path:
        """Write meta(-rNNNNN).json and `parts` steps/layers parts for this rank."""
        run_dir = Path(run_dir)
        (run_dir / schema.TRACE_DIR).mkdir(parents=True, exist_ok=True)
        (run_dir / schema.meta_name(self.rank)).write_text(json.dumps(self.meta(world_size)))
        steps, lay = self.steps_frame(), self.layers_frame()
        edges = np.linspace(0, self.n, parts + 1).astype(int)
        for p, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
            steps.filter(pl.col("step").is_between(a, b - 1)).write_parquet(
                run_dir / schema.TRACE_DIR / schema.part_name("steps", self.rank, p))
            if layers:
                lay.filter(pl.col("step").is_between(a, b - 1)).write_parquet(
                    run_dir / schema.TRACE_DIR / schema.part_name("layers", self.rank, p))
        return run_dir


def make_meta(rank, world_size, amp_dtype, scaler, params) -> dict:
    """The meta.json dict the Recorder writes (keys: schema.META_KEYS)."""
    return {"format": schema.META_FORMAT, "format_version": schema.FORMAT_VERSION, "torch_version": "2.13.0",
            "amp_autopsy_version": "0.1.0", "created": 1.7e9, "host": "test", "pid": 1, "rank": rank,
            "world_size": world_size, "device_type": "cpu", "amp_dtype": amp_dtype, "scaler": scaler,
            "params": params, "buffers": [], "factory": "tests.analyzer.report.report_models:build_small_mlp",
            "factory_kwargs": {}, "loss_fn": "tests.analyzer.report.report_models:mlp_loss", "layer_every": 1,
            "flush_every": 50}


# --------------------------------------------------------------------------- tiny real models
class _Attn(nn.Module):
    """One attention layer whose logits are NOT divided by sqrt(d): they overflow FP16."""

    def __init__(self, vocab: int = 16, d: int = 32, gain: float = 1.0):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)
        with torch.no_grad():
            self.emb.weight.mul_(gain)

    def forward(self, x):
        h = self.emb(x)
        att = self.q(h) @ self.k(h).transpose(-1, -2)  # no 1/sqrt(d): the bug
        return self.head(att.softmax(-1) @ self.v(h) + h)


def build_attn(vocab: int = 16, d: int = 32, gain: float = 1.0) -> nn.Module:
    return _Attn(vocab, d, gain)


def attn_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["x"])
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())


def build_sigmoid_mlp(depth: int = 10, width: int = 16, init_std: float = 0.02) -> nn.Module:
    """Deep sigmoid MLP with a small init: the gradient vanishes on its way back to the input."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Sigmoid()]
    layers.append(nn.Linear(width, 4))
    model = nn.Sequential(*layers)
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                m.weight.normal_(0, init_std)
                m.bias.zero_()
    return model


def build_small_mlp(width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 4))


def build_bn_mlp(width: int = 16) -> nn.Module:
    """Linear layers with a bias right before BatchNorm: BN subtracts the batch mean, so the
    bias gets (almost) no gradient while the weight learns. A common, harmless redundancy."""
    return nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(),
                         nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 4))


def mlp_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def weighted_mlp_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """``mlp_loss`` times the batch's ``weight`` (an annealed loss weight, e.g. an auxiliary term)."""
    return mlp_loss(model, batch) * batch["weight"]


class _SqrtNorm(nn.Module):
    """Features divided by 1 + their L2 norm, written as ``sqrt(sum(h * h))``.

    sqrt's derivative at 0 is infinite: a row whose features are exactly zero (an all-zero
    input: no biases before the norm) has a finite forward and loss, but backward gives
    0 / 0 = NaN in the gradient of ``proj.weight``, the layer that produced ``h``. ``inp``'s
    gradient stays finite (ReLU passes nothing back where its input is 0), and so does
    ``head``'s (its input row is 0).
    """

    def __init__(self, width: int = 16):
        super().__init__()
        self.inp = nn.Linear(width, width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        h = self.proj(torch.relu(self.inp(x)))
        r = torch.sqrt((h * h).sum(-1, keepdim=True))
        return self.head(h / (1 + r))


def build_sqrt_norm(width: int = 16) -> nn.Module:
    return _SqrtNorm(width)


def build_regression(width: int = 16) -> nn.Module:
    """Linear regression without a bias: with an identity design matrix every product is exact."""
    return nn.Linear(width, 1, bias=False)


def mse_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])


def mlp_loss_outside(model: nn.Module, batch: dict) -> torch.Tensor:
    """Loss computed from FP16 logits outside autocast: the loss tensor is float16."""
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(batch["x"])
    return F.cross_entropy(logits, batch["y"])


def batches(kind: str, n: int, seed: int = 0) -> list[dict]:
    """The `n` batches ``train_recorded`` uses by default, as a list a test can edit."""
    return list(_batches(kind, n, seed))


def _batches(kind: str, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(16, 4, generator=g)
    for _ in range(n):
        if kind == "tokens":
            x = torch.randint(0, 16, (8, 12), generator=g)
            yield {"x": x, "y": torch.roll(x, -1, dims=1)}
        else:
            x = torch.randn(32, 16, generator=g)
            yield {"x": x, "y": (x @ teacher).argmax(-1)}


def train_recorded(run_dir: Path, *, model: nn.Module, factory: str, factory_kwargs: dict, loss_fn,
                   steps: int, amp_dtype: torch.dtype | None, lr: float, kind: str = "vectors",
                   outside_autocast: bool = False, flush_every: int = 20, data: list[dict] | None = None,
                   sgd: bool = False, scaler: bool | None = None) -> Path:
    """An ordinary GradScaler loop with the real Recorder, on CPU.

    `data` replaces the default batches (see ``batches``); `sgd` uses plain SGD instead of Adam;
    `scaler` forces a GradScaler on or off (default: on for FP16 only).
    """
    from recorders import Recorder

    use_scaler = amp_dtype == torch.float16 if scaler is None else scaler
    scaler = torch.amp.GradScaler("cpu", enabled=use_scaler) if use_scaler else None
    opt = (torch.optim.SGD if sgd else torch.optim.Adam)(model.parameters(), lr=lr)
    rec = Recorder(run_dir, model, factory=factory, factory_kwargs=factory_kwargs, loss_fn=loss_fn,
                   scaler=scaler, amp_dtype=amp_dtype, optimizer=opt, flush_every=flush_every)
    with rec:
        for step, batch in enumerate(data if data is not None else _batches(kind, steps)):
            rec.begin_step(step, batch)
            opt.zero_grad(set_to_none=True)
            if outside_autocast:
                loss = mlp_loss_outside(model, batch)
            elif amp_dtype is None:
                loss = loss_fn(model, batch)
            else:
                with torch.autocast("cpu", dtype=amp_dtype):
                    loss = loss_fn(model, batch)
            if scaler is not None:
                scaler.scale(loss).backward()
                rec.end_step(loss)
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                rec.end_step(loss)
                if math.isfinite(loss.item()):
                    opt.step()
    return Path(run_dir)

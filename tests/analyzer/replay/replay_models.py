"""Tiny CPU models that fail in known ways, their loss functions, and a real recorded step.

Each scenario is a factory ``build_*(**kwargs) -> nn.Module`` and a loss ``loss(model, batch)``
importable as ``tests.analyzer.replay.replay_models:NAME``, which is what the recorder stores and the
replay resolves. ``record_step`` runs one real training step with the ``Recorder`` (autocast,
GradScaler) and returns the snapshot it wrote.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from recorders import Recorder

REF = "tests.analyzer.replay.replay_models"


# -- attention whose logits are not divided by sqrt(d): FP16 overflow -------------------------
class Attention(nn.Module):
    def __init__(self, d: int, scaled: bool):
        super().__init__()
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.scaled = scaled

    def forward(self, x, mask=None):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        logits = q @ k.transpose(-2, -1)
        if self.scaled:
            logits = logits / math.sqrt(q.shape[-1])
        if mask is not None and mask.is_floating_point():  # additive: 0 where allowed, -inf elsewhere
            logits = logits + mask
        elif mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        return logits.softmax(-1) @ v


class AttnNet(nn.Module):
    def __init__(self, d: int = 8, gain: float = 1.0, scaled: bool = False, causal: int = 0):
        super().__init__()
        self.attn = Attention(d, scaled)
        self.head = nn.Linear(d, 1)
        with torch.no_grad():  # q and k projections are gain * identity: logits = gain^2 <x, x'>
            self.attn.q_proj.weight.copy_(torch.eye(d) * gain)
            self.attn.k_proj.weight.copy_(torch.eye(d) * gain)
        if causal:  # a causal mask kept as a buffer, as nn.Transformer.generate_square_subsequent_mask builds it
            self.register_buffer("causal", torch.triu(torch.full((causal, causal), float("-inf")), diagonal=1))

    def forward(self, x, mask=None):
        if mask is None and hasattr(self, "causal"):
            mask = self.causal
        return self.head(self.attn(x, mask))


def build_attention(d: int = 8, gain: float = 1.0, scaled: bool = False, causal: int = 0) -> nn.Module:
    torch.manual_seed(0)
    return AttnNet(d, gain, scaled, causal)


def attention_mse(model, batch):
    return F.mse_loss(model(batch["x"], batch.get("mask")).float(), batch["y"])


# -- classifier whose loss takes log of a probability that is exactly 0 in FP32 ----------------
def build_classifier(gain: float = 100.0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    with torch.no_grad():  # logits = (2g, 0, -2g) for x = (2, 0, 0, 0): p(class 2) = exp(-4g)
        model[0].weight.zero_()
        model[0].weight[0, 0], model[0].weight[2, 0] = gain, -gain
        model[0].bias.zero_()
    return model


def log_prob_loss(model, batch):
    probs = model(batch["x"]).softmax(-1)
    return -torch.log(probs.gather(1, batch["y"][:, None])).mean()


# -- an L2 norm at a zero row: sqrt'(0) is infinite in backward --------------------------------
class RowNorm(nn.Module):
    def forward(self, h):
        return torch.sqrt((h * h).sum(-1))


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)
        self.norm = RowNorm()

    def forward(self, x):
        return self.norm(self.proj(x))


def build_norm() -> nn.Module:
    torch.manual_seed(0)
    return NormNet()


def mean_loss(model, batch):
    return model(batch["x"]).float().mean()


# -- a hand-written LayerNorm with eps=1e-12, which FP16 flushes to zero ---------------------
class TinyNorm(nn.Module):
    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, h):
        mu = h.mean(-1, keepdim=True)
        var = ((h - mu) ** 2).mean(-1, keepdim=True)
        return (h - mu) * torch.rsqrt(var + self.eps)


def build_eps_net(eps: float = 1e-12) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8, bias=False), TinyNorm(eps), nn.Linear(8, 1))


def mse(model, batch):
    return F.mse_loss(model(batch["x"]).float(), batch["y"])


def sum_mse(model, batch):
    return F.mse_loss(model(batch["x"]).float(), batch["y"], reduction="sum")


# -- a torch.library custom op that autocast knows nothing about ------------------------------
@torch.library.custom_op("ampautopsy_replaytests::square", mutates_args=())
def square(x: torch.Tensor) -> torch.Tensor:
    return x * x


@square.register_fake
def _(x):
    return torch.empty_like(x)


def _square_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _square_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * 2 * x


square.register_autograd(_square_backward, setup_context=_square_setup)


class Square(nn.Module):
    def forward(self, h):
        return square(h)


def build_custom_op_net(gain: float = 100.0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), Square(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4) * gain)
    return model


# -- a clean MLP ---------------------------------------------------------------------------------
def build_mlp(width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1))


# -- a real recorded step ------------------------------------------------------------------------
def _resolve(name: str):
    return globals()[name]


def record_step(run_dir: str | Path, *, factory: str, loss_fn: str, batch: dict,
                amp_dtype: torch.dtype | None, factory_kwargs: dict | None = None,
                init_scale: float | None = None, inject=None, manual: bool = False,
                **recorder_kwargs) -> Path:
    """Train one step with the Recorder on and return the snapshot it wrote.

    Args:
        factory / loss_fn: names in this module.
        inject: called with the model before the step (a fault injected at a known step).
        manual: force a snapshot (for a healthy step, which the recorder would not snapshot).
        recorder_kwargs: passed to ``Recorder`` (e.g. ``overflow_streak=1``).
    """
    factory_kwargs = dict(factory_kwargs or {})
    model = _resolve(factory)(**factory_kwargs)
    if inject is not None:
        inject(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if init_scale else None
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rec = Recorder(run_dir, model, factory=f"{REF}:{factory}", factory_kwargs=factory_kwargs,
                   loss_fn=f"{REF}:{loss_fn}", scaler=scaler, amp_dtype=amp_dtype, optimizer=opt, **recorder_kwargs)
    loss_callable = _resolve(loss_fn)
    with rec:
        rec.begin_step(0, batch)
        ctx = torch.autocast("cpu", dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
        with ctx:
            loss = loss_callable(model, batch)
        (scaler.scale(loss) if scaler else loss).backward()
        failure = rec.end_step(loss)
        if manual:
            rec.snapshot("manual")
        elif failure is None:
            raise AssertionError(f"{factory}/{loss_fn}: the step did not fail, nothing was recorded")
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    assert rec.snapshots, "the recorder wrote no snapshot"
    return rec.snapshots[-1]


# -- log(0) hidden by torch.where in forward; its backward still divides by zero ---------------
def where_log_loss(model, batch):
    p = (model(batch["x"]).float().abs() + 1.0) * batch["w"]  # exactly 0 where w == 0
    return torch.where(batch["w"] > 0, torch.log(p), torch.zeros_like(p)).mean()


# -- log_softmax whose FP16 output overflows on CPU, where CUDA autocast would run it in FP32 -
def build_wide_logits() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    with torch.no_grad():  # logits (40000, 0, -40000) for x = (1, 0, 0, 0): log p2 = -80000
        model[0].weight.zero_()
        model[0].weight[0, 0], model[0].weight[2, 0] = 40000.0, -40000.0
        model[0].bias.zero_()
    return model


def log_softmax_nll(model, batch):
    return F.nll_loss(F.log_softmax(model(batch["x"]), -1), batch["y"])


def per_sample_loss(model, batch):
    """A mistake users make: forgetting the reduction, so the "loss" is not a scalar."""
    return F.mse_loss(model(batch["x"]).float(), batch["y"], reduction="none")


def build_dropout_mlp(p: float = 0.5) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Dropout(p), nn.Linear(64, 1))


class _BrokenBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("this backward is not implemented")


class BrokenBackward(nn.Module):
    def forward(self, x):
        return _BrokenBackward.apply(x)


def build_broken_backward() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), BrokenBackward(), nn.Linear(4, 1))


CALLS = {"n": 0}


def first_call_differs_loss(model, batch):
    """log_prob_loss, with one extra op on the first call only: a non-deterministic forward."""
    CALLS["n"] += 1
    probs = model(batch["x"]).softmax(-1)
    if CALLS["n"] == 1:
        probs = probs * 1.0
    return -torch.log(probs.gather(1, batch["y"][:, None])).mean()


def build_deep_mlp(depth: int = 40) -> nn.Module:
    """Enough layers for a few hundred ops per run (progress bar tests)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), *[nn.Sequential(nn.Tanh(), nn.Linear(4, 4)) for _ in range(depth)],
                         nn.Linear(4, 1))


# -- logsumexp pooling over a row whose every position is masked (pytorch/pytorch#31829) -------
class LogsumexpPool(nn.Module):
    """Pool positions with logsumexp after adding a -inf mask; rows with no valid position give 0.

    The forward is finite (``where`` drops the -inf of a fully masked row), but the backward of
    logsumexp computes ``exp(x - result)`` = exp(-inf - -inf) = NaN there, which ``where``'s zero
    gradient cannot cancel (0 * NaN). `mask_form` is how the -inf bias is written.
    """

    def __init__(self, d: int, mask_form: str):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, 1)
        self.mask_form = mask_form

    def _bias(self, mask: torch.Tensor) -> torch.Tensor:
        neg = float("-inf")
        if self.mask_form == "masked_fill":
            return torch.zeros(mask.shape).masked_fill(~mask, neg)
        if self.mask_form == "where":
            return torch.where(mask, 0.0, neg)
        if self.mask_form == "full":
            return torch.where(mask, torch.zeros(mask.shape), torch.full(mask.shape, neg))
        if self.mask_form == "index_put":
            bias = torch.zeros(mask.shape)
            bias[~mask] = neg
            return bias
        raise ValueError(f"unknown mask_form {self.mask_form!r}")

    def forward(self, x, mask):
        s = self.proj(x)                                          # (B, T, d)
        pooled = torch.logsumexp(s + self._bias(mask)[..., None], dim=1)  # -inf for a fully masked row
        pooled = torch.where(mask.any(1, keepdim=True), pooled, torch.zeros_like(pooled))
        return self.head(pooled)


def build_logsumexp_pool(d: int = 4, mask_form: str = "masked_fill") -> nn.Module:
    torch.manual_seed(0)
    return LogsumexpPool(d, mask_form)


def pool_mse(model, batch):
    return F.mse_loss(model(batch["x"], batch["mask"]).float(), batch["y"])


# -- Linear -> BatchNorm1d: inputs of ~1e5 overflow autocast's FP16 cast (pytorch/pytorch#115500) -
def build_bn_net(d: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


# -- buffers a forward reads, or keeps as an exponential moving average it never reads ---------
class BufferNet(nn.Module):
    """``center`` is subtracted from the input (read); ``ema`` tracks the batch mean (only written)."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, 1)
        self.register_buffer("center", torch.zeros(d))
        self.register_buffer("ema", torch.zeros(d))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return self.fc(x - self.center)


def build_buffer_net(d: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return BufferNet(d)


# -- a Gram matrix that overflows FP16: of the batch alone, or of a projection by the weights ---------
class Gram(nn.Module):
    """``h @ h^T``: FP16 under autocast, inf once a row's squared norm passes 65504."""

    def forward(self, h):
        return h @ h.transpose(-2, -1)


class GramNet(nn.Module):
    def __init__(self, project: bool, d: int = 8):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False) if project else None
        self.gram, self.head = Gram(), nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.gram(self.proj(x) if self.proj is not None else x))


def build_gram(project: bool = False) -> nn.Module:
    """Without `project` the overflowing value is the batch's alone; with it, the batch times the weights."""
    torch.manual_seed(0)
    model = GramNet(project)
    if project:
        with torch.no_grad():
            model.proj.weight.copy_(torch.eye(8) * 300.0)  # rows of norm ~850: squared ~7e5 > 65504
    return model


def train_until_failure(run_dir: str | Path, *, factory: str, loss_fn: str, batches: list[dict],
                        amp_dtype: torch.dtype | None, factory_kwargs: dict | None = None) -> tuple[int, Path]:
    """Train with the Recorder over `batches` (SGD, no GradScaler) until a step fails.

    Returns the failing step and the snapshot the recorder wrote for it.
    """
    factory_kwargs = dict(factory_kwargs or {})
    model = _resolve(factory)(**factory_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loss_callable = _resolve(loss_fn)
    with Recorder(run_dir, model, factory=f"{REF}:{factory}", factory_kwargs=factory_kwargs,
                  loss_fn=f"{REF}:{loss_fn}", amp_dtype=amp_dtype, optimizer=opt) as rec:
        for step, batch in enumerate(batches):
            rec.begin_step(step, batch)
            ctx = torch.autocast("cpu", dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
            with ctx:
                loss = loss_callable(model, batch)
            loss.backward()
            if rec.end_step(loss) is not None:
                assert rec.snapshots, "the recorder wrote no snapshot"
                return step, rec.snapshots[-1]
            opt.step()
            opt.zero_grad()
    raise AssertionError(f"{factory}/{loss_fn}: no step failed")

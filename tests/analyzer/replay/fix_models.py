"""Tiny models for the fixes tried on a snapshot (``analyzer.replay.fixes.registry``), and their recorded steps.

``build_logit`` with ``bce_loss`` is a hand-written binary cross-entropy:
``-(y*log(p) + (1-y)*log(1-p))`` with ``p = sigmoid(x)``. A logit of 10 gives ``p = 0.9999546``
in FP32 (``1 - p = 4.5e-5``, finite log), but FP16's spacing below 1 is 4.9e-4 (BF16's 3.9e-3),
so ``p`` rounds to exactly 1.0 there, ``1 - p`` is 0 and ``log(0) = -inf``: an FP16 underflow
that BF16 does not fix. Importable as ``tests.analyzer.replay.fix_models:NAME``, which is what the
recorder stores and replay resolves.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from recorders import Recorder

REF = "tests.analyzer.replay.fix_models"


def build_logit(gain: float = 10.0) -> nn.Module:
    """One linear unit whose logit is `gain` * x[0]: x = (1, 0, 0, 0) gives a logit of `gain`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].weight[0, 0] = gain
        model[0].bias.zero_()
    return model


def bce_loss(model, batch):
    """The hand-written BCE a new user writes (sigmoid, then two logs)."""
    p = torch.sigmoid(model(batch["x"]))
    y = batch["y"]
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def bce_batch() -> dict:
    """A confidently wrong sample (logit +10, label 0) and a right one (logit -1, label 0)."""
    return {"x": torch.tensor([[1.0, 0.0, 0.0, 0.0], [-0.1, 0.0, 0.0, 0.0]]), "y": torch.zeros(2, 1)}


def record(run_dir: str | Path, *, factory: str, loss_fn: str, batch: dict, amp_dtype: torch.dtype,
           factory_kwargs: dict | None = None) -> Path:
    """Train one step with the real Recorder (autocast, SGD) and return the snapshot it wrote."""
    factory_kwargs = dict(factory_kwargs or {})
    model = globals()[factory](**factory_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_callable = globals()[loss_fn]
    with Recorder(run_dir, model, factory=f"{REF}:{factory}", factory_kwargs=factory_kwargs,
                  loss_fn=f"{REF}:{loss_fn}", amp_dtype=amp_dtype, optimizer=opt) as rec:
        rec.begin_step(0, batch)
        with torch.autocast("cpu", dtype=amp_dtype) if amp_dtype else contextlib.nullcontext():
            loss = loss_callable(model, batch)
        loss.backward()
        assert rec.end_step(loss) is not None, f"{factory}/{loss_fn}: the step did not fail"
        opt.step()
    assert rec.snapshots, "the recorder wrote no snapshot"
    return rec.snapshots[-1]


class MaskedScores(nn.Module):
    """Self-attention scores with a padding bias built in FP32 from ``torch.finfo(torch.float32).min``.

    The bias is cast to the scores' dtype: FP32's min is past FP16's (and BF16's) range, so it
    becomes -inf, and a sequence whose every position is padding has a softmax row of -inf only:
    NaN. The mistake HF models made before they filled with ``torch.finfo(scores.dtype).min``.
    """

    def __init__(self, d: int = 4):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x, keep):
        h = self.proj(x)
        s = h @ h.transpose(-2, -1)
        bias = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        s = s + bias[:, None, :].to(s.dtype)
        return (s.softmax(-1) @ h).sum(-1)


def build_masked_scores(d: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return MaskedScores(d)


def masked_scores_loss(model, batch):
    return model(batch["x"], batch["keep"]).float().pow(2).mean()


def masked_batch() -> dict:
    """Two sequences of 3; the second is padding only."""
    keep = torch.tensor([[True, True, False], [False, False, False]])
    return {"x": torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0)), "keep": keep}


# -- a custom op autocast knows nothing about, whose intermediate overflows FP16 but whose result fits --
@torch.library.custom_op("ampautopsy_fixtests::softplus", mutates_args=())
def softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.log1p(torch.exp(x))  # exp(20) = 4.9e8 is inf in FP16; softplus(20) = 20 fits


@softplus.register_fake
def _(x):
    return torch.empty_like(x)


def _softplus_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _softplus_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * torch.sigmoid(x)


softplus.register_autograd(_softplus_backward, setup_context=_softplus_setup)


class Softplus(nn.Module):
    def forward(self, h):
        return softplus(h)


def build_softplus_net(gain: float = 20.0) -> nn.Module:
    """Linear(4, 4) = gain * identity, the custom softplus, Linear(4, 1): x = e_0 feeds it `gain`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), Softplus(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4) * gain)
    return model


def mse(model, batch):
    return torch.nn.functional.mse_loss(model(batch["x"]).float(), batch["y"])


# -- a hand-written logsumexp whose FP16 exp overflows ---------------------------------------------
class HandLogSumExp(nn.Module):
    """Scores, then ``log(sum(exp(s)))`` written out by hand: FP16's exp overflows once s passes 11.09."""

    def __init__(self, gain: float = 4.0):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        with torch.no_grad():
            self.proj.weight.fill_(gain)
            self.proj.bias.zero_()

    def forward(self, x):
        s = self.proj(x)
        return torch.log(torch.exp(s).sum(-1))


def build_hand_logsumexp(gain: float = 4.0) -> nn.Module:
    return HandLogSumExp(gain)


def logsumexp_loss(model, batch):
    return model(batch["x"]).float().mean()


def logsumexp_batch() -> dict:
    return {"x": torch.ones(2, 4)}  # every score is 16: exp(16) ~ 8.9e6 fits FP32, not FP16

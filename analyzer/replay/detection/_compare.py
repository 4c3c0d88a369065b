"""A finite low-precision step against the FP32 run of the same step: the loss and every gradient.

``compare(low, fp32)`` reads the two runs replay already made (their losses and the gradients
``RunTrace.grads`` holds): no extra run. The step is *beyond tolerance* when

- the loss differs by more than ``LOSS_K`` x the dtype's eps, relative to the FP32 loss; or
- the whole gradient (every parameter's, as one vector) differs by more than ``GRAD_K`` x eps,
  relative to the FP32 gradient's norm.

Why these bounds: one rounding to the dtype moves a value by at most eps/2 relative, and a step's
errors are many such roundings, partly cancelling; a healthy FP16/BF16 step lands within a fraction
of eps of FP32 on the loss and within about one eps on the whole gradient (docs/replay.md has the
measurements on every sample scenario). The bounds sit well above that, so that only a step whose
error is many roundings' worth, not noise, is called wrong. Per-parameter errors (relative error
and cosine) are reported, never judged alone: a parameter whose FP32 gradient nearly cancels has a
large relative error from rounding alone.

Example:
    >>> c = compare(runs["bfloat16"], runs["float32"])   # doctest: +SKIP
    >>> c.beyond, round(c.loss_eps, 1), round(c.grad_eps, 1)  # doctest: +SKIP
    (True, 9.3, 41.0)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..result.trace import LOW_PRECISION, RunTrace

__all__ = ["LOSS_K", "GRAD_K", "Comparison", "compare", "eps_of", "grad_norm"]

LOSS_K = 4.0   # the loss: at most this many eps of the dtype, relative to the FP32 loss
GRAD_K = 8.0   # the whole gradient: at most this many eps, relative to the FP32 gradient's norm
_WORST = 3     # parameters named in the evidence, largest relative error first


def eps_of(precision: str) -> float:
    """The dtype's machine epsilon (BF16 2^-7, FP16 2^-10)."""
    return float(torch.finfo(getattr(torch, precision)).eps)


@dataclass(frozen=True)
class Comparison:
    """How far a finite low-precision step is from the FP32 step.

    Attributes:
        precision: the low precision compared.
        eps: its machine epsilon.
        loss / fp32_loss: the two losses.
        loss_rel: |loss - fp32_loss| / |fp32_loss|; ``loss_eps``: the same in units of eps.
        grad_rel: ||g - g32|| / ||g32|| over every parameter's gradient as one vector (None: no
            gradients to compare); ``grad_eps``: the same in units of eps; ``grad_cosine``: their cosine.
        worst: the parameters with the largest relative error: ``{param, rel, cosine, norm, fp32_norm}``.
        loss_k / grad_k: the tolerances, in eps.
    """

    precision: str
    eps: float
    loss: float
    fp32_loss: float
    loss_rel: float
    grad_rel: float | None
    grad_cosine: float | None
    worst: tuple[dict, ...]
    loss_k: float = LOSS_K
    grad_k: float = GRAD_K

    @property
    def loss_eps(self) -> float:
        return self.loss_rel / self.eps

    @property
    def grad_eps(self) -> float | None:
        return None if self.grad_rel is None else self.grad_rel / self.eps

    @property
    def loss_beyond(self) -> bool:
        return self.loss_eps > self.loss_k

    @property
    def grad_beyond(self) -> bool:
        return self.grad_eps is not None and self.grad_eps > self.grad_k

    @property
    def beyond(self) -> bool:
        """Whether the step differs from FP32 beyond the tolerance (loss or gradient)."""
        return self.loss_beyond or self.grad_beyond

    def to_dict(self) -> dict:
        return {"precision": self.precision, "eps": self.eps, "loss": self.loss, "fp32_loss": self.fp32_loss,
                "loss_rel_error": self.loss_rel, "loss_error_eps": self.loss_eps,
                "grad_rel_error": self.grad_rel, "grad_error_eps": self.grad_eps, "grad_cosine": self.grad_cosine,
                "tolerance_eps": {"loss": self.loss_k, "grad": self.grad_k}, "beyond_tolerance": self.beyond,
                "worst_params": [dict(w) for w in self.worst]}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def grad_norm(run: RunTrace) -> float | None:
    """The total L2 norm of the run's unscaled gradients (None: no gradients)."""
    if not run.grads:
        return None
    sq = sum(float(g.detach().double().pow(2).sum()) for g in run.grads.values())  # NB: host reads
    return math.sqrt(sq) / run.scale


def _host_rows(sums: list[torch.Tensor]) -> list[list[float]]:
    """The per-parameter sums on the host: one read (NB: a sync), or one per device for a model split across them."""
    if not sums:
        return []
    try:
        return torch.stack(sums).tolist()
    except RuntimeError:  # sums on several devices
        return [t.tolist() for t in sums]


def compare(low: RunTrace, fp32: RunTrace) -> Comparison | None:
    """`low` against `fp32`: both finite, `low` in a low precision; None otherwise."""
    if low.precision not in LOW_PRECISION or not (low.finite and fp32.finite):
        return None
    diff_sq = ref_sq = low_sq = dot = 0.0
    per: list[dict] = []
    names, sums = [], []
    for name, g32 in (fp32.grads or {}).items():
        g = (low.grads or {}).get(name)
        if g is None or g.shape != g32.shape:
            continue
        a = g.detach().double() / low.scale
        b = g32.detach().double() / fp32.scale
        names.append(name)
        sums.append(torch.stack([(a - b).pow(2).sum(), b.pow(2).sum(), a.pow(2).sum(), (a * b).sum()]))
    rows = _host_rows(sums)
    for name, (d2, b2, a2, ab) in zip(names, rows):
        diff_sq, ref_sq, low_sq, dot = diff_sq + d2, ref_sq + b2, low_sq + a2, dot + ab
        cos = ab / math.sqrt(a2 * b2) if a2 > 0 and b2 > 0 else (1.0 if a2 == b2 else 0.0)
        per.append({"param": name, "rel": math.sqrt(d2 / b2) if b2 > 0 else (0.0 if d2 == 0 else math.inf),
                    "cosine": cos, "norm": math.sqrt(a2), "fp32_norm": math.sqrt(b2)})
    grad_rel = cosine = None
    if per:
        grad_rel = math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else (0.0 if diff_sq == 0 else math.inf)
        cosine = dot / math.sqrt(low_sq * ref_sq) if low_sq > 0 and ref_sq > 0 else None
    worst = tuple(sorted(per, key=lambda w: -w["rel"])[:_WORST])
    return Comparison(low.precision, eps_of(low.precision), low.loss, fp32.loss, _rel(low.loss, fp32.loss),
                      grad_rel, cosine, worst)

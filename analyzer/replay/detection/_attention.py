"""Attention logits among the recorded ops, and what dividing them by sqrt(head_dim) would do.

Attention advice rests on what the replay saw, never on a module's name: the culprit is the
logits matmul of an attention only when, in the recorded forward, its output reaches a softmax
(through views, casts, masks and scalings) whose output feeds another matmul (``softmax(q k^T) v``;
a dropout between them, its mask multiplied in, is looked through).
``head_dim`` is the contraction dimension of the culprit's own captured inputs, and the largest
logit is the culprit recomputed in FP32 from them (the shadow check), so "divide by sqrt(d)" is
offered only when that value divided by sqrt(head_dim) is under the dtype's max, with the numbers.
A ``scaled_dot_product_attention`` call scales by itself and gets no such advice.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..result.trace import RunTrace
    from ..result.diagnosis import Diagnosis

__all__ = ["is_attention_logits", "sqrt_d_check"]

_MATMUL = frozenset({"aten.bmm", "aten.mm", "aten.matmul", "aten.baddbmm", "aten.addmm", "aten.einsum"})
_SOFTMAX = frozenset({"aten._softmax", "aten.softmax", "aten._safe_softmax"})
# Ops between the logits matmul and its softmax that keep them logits: views, casts, masks, scalings.
_BETWEEN = frozenset({"aten._to_copy", "aten.detach", "aten.alias", "aten.view", "aten._unsafe_view", "aten.t",
                      "aten.transpose", "aten.expand", "aten.clone", "aten.contiguous", "aten.permute",
                      "aten.reshape", "aten.unsqueeze", "aten.squeeze", "aten.mul", "aten.div", "aten.add",
                      "aten.sub", "aten.masked_fill", "aten.masked_fill_", "aten.where", "aten.add_", "aten.mul_",
                      "aten.div_"})
# Ops between the softmax and the matmul with the values: views, casts, dropout and its rescaling.
_AFTER = frozenset(_BETWEEN - {"aten.add", "aten.sub", "aten.add_", "aten.masked_fill", "aten.masked_fill_",
                               "aten.where"} | {"aten.native_dropout", "aten.dropout"})
_WINDOW = 48  # ops looked at after the matmul, and after the softmax


def _reaches(run: RunTrace, i: int, through: frozenset[str], targets: frozenset[str]) -> int | None:
    """The first forward op of `targets` within `_WINDOW` ops after `i` that reads op `i`'s value
    through `through` ops only (other readers, a detach for logging, a dropout mask, are passed by)."""
    carry = {i}
    for rec in run.records[i + 1:i + 1 + _WINDOW]:
        if rec.phase != "forward":
            return None
        if any(p in carry for _, p in rec.inputs):
            if rec.name in targets:
                return rec.index
            if rec.name in through:
                carry.add(rec.index)
    return None


def is_attention_logits(run: RunTrace, i: int) -> bool:
    """Op `i` is a forward matmul whose output reaches a softmax that feeds another matmul."""
    rec = run.records[i]
    if rec.phase != "forward" or rec.name not in _MATMUL:
        return False
    sm = _reaches(run, i, _BETWEEN, _SOFTMAX)
    return sm is not None and _reaches(run, sm, _AFTER, _MATMUL) is not None


def _head_dim(name: str, captured) -> int | None:
    """The contraction dimension of the matmul's captured inputs."""
    if captured is None:
        return None
    tensors = [a for a in captured[0] if isinstance(a, torch.Tensor)]
    if name in ("aten.baddbmm", "aten.addmm"):
        tensors = tensors[1:]
    if len(tensors) < 2 or tensors[0].dim() < 1:
        return None
    return int(tensors[0].shape[-1])


def sqrt_d_check(d: Diagnosis) -> dict | None:
    """For a culprit that is an attention's logits matmul: what dividing them by sqrt(head_dim) gives.

    Returns:
        ``{head_dim, logit_absmax, scaled_absmax, dtype_max, fits}`` (the largest logit recomputed
        in FP32 from the culprit's inputs, and divided by sqrt(head_dim)); None when the culprit
        is not one, or its inputs or FP32 value are unknown.
    """
    c, run = d.culprit, d.trace
    if c is None or run is None or not is_attention_logits(run, c["index"]):
        return None
    hd = _head_dim(c["op"], run.captured)
    logit = (c.get("shadow") or {}).get("float32")
    if not hd or not isinstance(logit, float) or not math.isfinite(logit):
        return None
    top = float(torch.finfo(getattr(torch, c["precision"])).max)
    scaled = logit / math.sqrt(hd)
    return {"head_dim": hd, "logit_absmax": logit, "scaled_absmax": scaled, "dtype_max": top, "fits": scaled < top}

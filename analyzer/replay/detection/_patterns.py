"""Hand-written patterns recognised in the ops that fed a replay's culprit, each with its advice.

They are what replay cannot try as a fix on the snapshot (a loss rewritten with logsigmoid, a norm
with an eps inside the sqrt, a finite mask fill), so they are printed as untested advice
(``_advice.advice_with_status``).
"""
from __future__ import annotations

import torch

__all__ = ["patterns"]

# The largest finite value per dtype: a mask filled with torch.finfo(dtype).min shows as one of them.
_MAX = frozenset(float(torch.finfo(d).max) for d in (torch.float16, torch.bfloat16, torch.float32))

# -- hand-written patterns around the culprit ------------------------------------------------------
_THROUGH = frozenset({"aten._to_copy", "aten.detach", "aten.alias", "aten.view", "aten._unsafe_view", "aten.t",
                      "aten.transpose", "aten.expand", "aten.clone", "aten.contiguous", "aten.gather",
                      "aten.index", "aten.select", "aten.slice", "aten.squeeze", "aten.unsqueeze",
                      "aten.reshape", "aten.permute", "aten.neg", "aten.clamp", "aten.clamp_min"})
_NODE_OPS = {"Log": "aten.log", "Sqrt": "aten.sqrt", "Rsqrt": "aten.rsqrt", "Div": "aten.div", "Pow": "aten.pow"}


def _producer(run, i: int | None) -> int | None:
    """The op that computed op `i`'s first floating input, looking through casts, views, gathers."""
    while i is not None:
        rec = run.records[i]
        p = next((p for _, p in rec.inputs if p is not None), None)
        if p is None or run.records[p].name not in _THROUGH:
            return p
        i = p
    return None


def _consumer(run, i: int | None) -> int | None:
    """The first forward op after op `i` that reads its output, looking through casts and views."""
    if i is None:
        return None
    seen = {i}
    for rec in run.records[i + 1:]:
        if rec.phase != "forward":
            return None
        if any(p in seen for _, p in rec.inputs):
            if rec.name not in _THROUGH:
                return rec.index
            seen.add(rec.index)
    return None


def _exp_advice(run, i: int) -> str | None:
    """Advice for a hand-written exp whose result feeds a log: softplus, logaddexp, logsumexp, log_softmax."""
    c1 = _consumer(run, i)
    n1 = run.records[c1].name if c1 is not None else None
    c2 = _consumer(run, c1) if c1 is not None else None
    n2 = run.records[c2].name if c2 is not None else None
    why = "exp(x) overflows once x passes the dtype's log(max) (11.09 in FP16, 88.7 in BF16 and FP32)"
    if n1 == "aten.log1p" or (n1 in ("aten.add", "aten.add_") and len(run.records[c1].inputs) == 1
                              and n2 == "aten.log"):
        return (f"log(1 + exp(x)) is a hand-written softplus, and {why}: use torch.nn.functional.softplus(x), "
                "which computes it stably (x itself where x is large).")
    if n1 in ("aten.add", "aten.add_") and n2 == "aten.log":
        return f"log(exp(a) + b) is hand-written, and {why}: use torch.logaddexp(a, log(b)) or torch.logsumexp."
    if n1 == "aten.sum" and n2 == "aten.log":
        return f"log(sum(exp(x))) is a hand-written logsumexp, and {why}: use torch.logsumexp(x, dim)."
    if n1 == "aten.div" and (n2 == "aten.log" or _consumer(run, c2) is not None
                             and run.records[_consumer(run, c2)].name == "aten.log"):
        return (f"log(exp(x) / sum(exp(x))) is a hand-written log-softmax, and {why}: use "
                "torch.nn.functional.log_softmax(x, dim), or cross_entropy on the logits.")
    if n1 == "aten.log" or n2 == "aten.log":
        return f"exp feeds a log here, and {why}: compute the pair in log space (torch.logsumexp, log_softmax, softplus)."
    return None


def _forward_op(run, c) -> int | None:
    """The culprit's own op in forward, or the forward op whose backward node failed."""
    if c["phase"] == "forward":
        return c["index"]
    node = c.get("node") or ""
    op = next((v for k, v in _NODE_OPS.items() if node.startswith(k + "Backward")), None)
    if op is None:
        return None
    return next((r.index for r in run.records if r.phase == "forward" and r.name == op
                 and r.source == c.get("source") and r.module == c["module"]), None)


def patterns(result) -> list[str]:
    """Advice for a hand-written pattern recognised in the ops that fed the culprit (untested)."""
    c, run = result.culprit, result.culprit_trace
    if c is None or run is None or result.verdict in ("healthy", "nonfinite_input"):
        return []
    out = []
    node = c.get("node") or ""
    i = _forward_op(run, c)
    name = run.records[i].name if i is not None else None
    p = _producer(run, i) if i is not None else None
    src = run.records[p].name if p is not None else None
    before = _producer(run, p) if src == "aten.rsub" else None
    if name == "aten.log" and before is not None and run.records[before].name == "aten.sigmoid":
        out.append("log(1 - sigmoid(x)) rounds to log(0) once sigmoid(x) rounds to 1: use "
                   "torch.nn.functional.logsigmoid(-x) for log(1 - sigmoid(x)), or compute the whole loss with "
                   "torch.nn.functional.binary_cross_entropy_with_logits(x, y) on the logits.")
    elif name == "aten.log" and src == "aten.sigmoid":
        out.append("log(sigmoid(x)) rounds to log(0) once sigmoid(x) rounds to 0: use "
                   "torch.nn.functional.logsigmoid(x), or binary_cross_entropy_with_logits on the logits.")
    elif name == "aten.log" and src in ("aten._softmax", "aten.softmax"):
        out.append("log(softmax(x)) is log(0) once a probability rounds to 0: use "
                   "torch.nn.functional.log_softmax(x, dim), or cross_entropy on the logits.")
    if name == "aten.exp" and c["phase"] == "forward":
        exp = _exp_advice(run, i)
        if exp:
            out.append(exp)
    if name in ("aten.sqrt", "aten.rsqrt") and src == "aten.sum" and _squares(run, _producer(run, p)):
        out.append("sqrt(sum(x**2)) has an infinite derivative where x is all zeros: use "
                   "torch.linalg.vector_norm(x, dim=...) or put an eps inside the sqrt: sqrt(sum(x**2) + eps).")
    elif "NormBackward" in node:
        out.append("The gradient of a norm is NaN/Inf where its input is all zeros: add an eps "
                   "(x.norm(dim=...).clamp_min(eps)) or use torch.linalg.vector_norm with an eps inside a sqrt.")
    fill = _mask_fill(run, c, result)
    if fill:
        out.append(f"A mask filled with {fill} turns a row whose every entry is masked into NaN/Inf (-inf - -inf; "
                   "float32's finfo.min is -inf once cast to a 16-bit dtype, and finfo.min plus anything overflows): "
                   "fill with a finite value of the scores' own dtype, built after any cast (-1e4 in FP16), or "
                   "drop the rows that have no unmasked entry.")
    return out


def _squares(run, i: int | None) -> bool:
    if i is None:
        return False
    rec = run.records[i]
    if rec.name == "aten.pow":
        return True
    ps = [p for _, p in rec.inputs]
    return rec.name == "aten.mul" and len(ps) == 2 and ps[0] is not None and ps[0] == ps[1]


def _mask_fill(run, c, result) -> str | None:
    """"-inf" or "finfo.min" when such a fill fed the culprit's failure, else None."""
    if c.get("literal_nonfinite") or result.mask_inputs:
        return "-inf"
    for rec in run.records[:c["index"]]:
        if rec.name in ("aten.masked_fill", "aten.masked_fill_", "aten.where", "aten.full", "aten.fill_") \
                and any(run.absmax[s] in _MAX for s in rec.outputs):
            return "torch.finfo(dtype).min"
    return None

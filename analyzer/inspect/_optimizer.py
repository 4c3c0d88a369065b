"""Optimizer checks of ``analyzer inspect``: ``optimizer_eps_underflow`` and ``lost_updates``.

Both read one checkpoint's optimizer ``param_groups`` (``OptimizerInfo.groups``) and its per-parameter
state, and both concern parameters kept in FP16/BF16 (a model trained with ``model.half()`` or
pure-BF16 fine-tuning), where the optimizer's arithmetic runs in the parameter's dtype:

- ``optimizer_eps_underflow``: a group's ``eps`` rounds to 0 in its state's dtype (Adam's default
  1e-8 is 0 in float16), or sits below that dtype's smallest normal. Any element whose gradient
  has been exactly 0 then gets the update 0 / (sqrt(0) + 0) = NaN.
- ``lost_updates``: the update Adam's state implies, lr * m_hat / (sqrt(v_hat) + eps), is below half
  an ulp of the weight for most elements, so ``param.add_(update)`` rounds it away and the weight
  never changes although its gradients are normal.

Real output (``analyzer inspect`` of ``torch.save({"model": ..., "optimizer": ...})`` taken from the
pure-FP16 embedding regressor of ``tests/update_runs.py`` right after the update that broke it)::

    findings, worst first:
      error    nonfinite_weights          1 weight holds NaN/Inf: model.emb.weight (56 of 64 values); ...
      warning  optimizer_eps_underflow    optimizer param group 0: eps 1e-08 is 0 in float16 (its state's
      dtype): an element whose gradient has been 0 gets 0/(sqrt(0)+eps) = NaN, and a tiny gradient an
      infinite update; set eps to at least 6.1e-05 (float16's smallest normal), or keep the parameters
      and the optimizer state in FP32 (torch.autocast for the forward)

and of a BF16 ``Linear`` whose weights are 1.0 after three Adam steps at lr 1e-4::

      warning  lost_updates  2 low-precision parameters lose most of Adam's update to rounding
      (lr*m_hat/(sqrt(v_hat)+eps) below half an ulp of the weight, so the weight does not change):
      model.weight (bfloat16: 100% of updated elements, typical update 5.7e-05 vs half an ulp 0.0039); ...

How to read it: each finding names the group or the parameters and the dtype the arithmetic ran in.
Elements whose implied update is exactly 0 (no gradient yet, e.g. unused embedding rows) are left
out of the ``lost_updates`` fractions: nothing was lost there.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..findings import Finding
from ..load.checkpoint import Checkpoint, Entry

__all__ = ["optimizer_findings", "eps_in_dtype", "half_ulp", "LOST_FRAC"]

LOW_PRECISION = (torch.float16, torch.bfloat16)
LOST_FRAC = 0.5          # "most elements": more than half of those with a non-zero update
_CHUNK = 1 << 20         # elements per piece: bounded memory on any parameter size
_STATE_SLOTS = ("exp_avg_sq", "exp_avg", "square_avg", "momentum_buffer", "max_exp_avg_sq")
_FIXES = ("keep FP32 master weights (train with FP32 parameters under torch.autocast, or let the "
          "optimizer hold an FP32 copy), raise the lr of those parameters, or use stochastic rounding / "
          "Kahan-compensated updates for low-precision weights")


def eps_in_dtype(eps: float, dtype: torch.dtype) -> float:
    """`eps` as the optimizer's arithmetic sees it: rounded to `dtype` (1e-8 -> 0.0 in float16)."""
    return float(torch.tensor(eps, dtype=torch.float64).to(dtype))


def half_ulp(w: torch.Tensor) -> torch.Tensor:
    """Half the spacing of `w`'s dtype at each |w|, as float32: an update smaller than this rounds away."""
    a = w.abs()
    nxt = torch.nextafter(a, torch.full_like(a, math.inf))
    return (nxt.float() - a.float()) / 2


def _state_dtype(ck: Checkpoint, names: list[str], weights: dict[str, Entry]) -> torch.dtype | None:
    """The dtype the group's optimizer arithmetic runs in: its state's, else its parameters'."""
    for e in ck.entries:
        if e.role == "optimizer" and e.param in names and e.slot in _STATE_SLOTS:
            return e.tensor.dtype
    for n in names:
        if n in weights:
            return weights[n].tensor.dtype
    return None


def _eps_findings(ck: Checkpoint, prefix: str, weights: dict[str, Entry]) -> list[Finding]:
    out = []
    for o in ck.optimizers:
        for gi, g in enumerate(o.groups):
            eps = g.get("eps")
            if not isinstance(eps, float) or not math.isfinite(eps):
                continue
            dtype = _state_dtype(ck, list(g.get("params", [])), weights)
            if dtype is None or not dtype.is_floating_point:
                continue
            rounded, tiny = eps_in_dtype(eps, dtype), torch.finfo(dtype).tiny
            if rounded != 0 and abs(eps) >= tiny:
                continue
            dname = str(dtype).removeprefix("torch.")
            what = (f"eps {eps:g} is 0 in {dname}" if rounded == 0 else
                    f"eps {eps:g} is below {dname}'s smallest normal {tiny:.2g} (a subnormal: it keeps few bits "
                    "and some hardware flushes it to 0)")
            where = f"{o.path or 'optimizer'} param group {gi}"
            fix = (f"set eps to at least {tiny:.2g} ({dname}'s smallest normal), or keep the parameters and "
                   "the optimizer state in FP32 (torch.autocast for the forward)")
            params = list(g.get("params", []))
            msg = (f"{prefix}{where}: {what} (its state's dtype): an element whose gradient has been 0 gets "
                   f"0/(sqrt(0)+eps) = NaN, and a tiny gradient an infinite update; {fix}")
            out.append(Finding("optimizer_eps_underflow", "warning", ck.step, msg, {
                "file": ck.path, "optimizer": o.path, "group": gi, "eps": eps, "eps_in_dtype": rounded,
                "dtype": dname, "smallest_normal": tiny, "params": params[:20], "n_params": len(params)}))
    return out


def _adam_slots(ck: Checkpoint) -> dict[str, dict[str, torch.Tensor]]:
    slots: dict[str, dict[str, torch.Tensor]] = {}
    for e in ck.entries:
        if e.role == "optimizer" and e.param is not None and e.slot in ("exp_avg", "exp_avg_sq", "step"):
            slots.setdefault(e.param, {})[e.slot] = e.tensor
    return slots


def _lost(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: dict[str, Any], step: float) -> dict | None:
    """Count elements whose implied Adam update is non-zero yet below half an ulp of the weight."""
    b1, b2 = g["betas"]
    if not (0 <= b1 < 1 and 0 <= b2 < 1):  # values read from a file: Adam itself refuses others
        return None
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    if not (bc1 > 0 and bc2 > 0):
        return None
    lr, eps = float(g["lr"]), float(g.get("eps", 0.0))
    wf, mf, vf = w.reshape(-1), m.reshape(-1), v.reshape(-1)
    moved = lost = 0
    upd_sum = ulp_sum = 0.0
    for i in range(0, wf.numel(), _CHUNK):
        u = lr * (mf[i:i + _CHUNK].float() / bc1) / (vf[i:i + _CHUNK].float().clamp_min(0).sqrt()
                                                      / math.sqrt(bc2) + eps)
        ok = torch.isfinite(u) & (u != 0)
        h = half_ulp(wf[i:i + _CHUNK])
        au = u.abs()
        small = ok & (au < h)
        moved += int(ok.sum())
        lost += int(small.sum())
        upd_sum += float(au[ok].log10().sum())
        ulp_sum += float(h[ok].clamp_min(1e-45).log10().sum())
    if moved == 0:
        return None
    return {"fraction": lost / moved, "lost": lost, "with_update": moved, "numel": wf.numel(),
            "typical_update": 10 ** (upd_sum / moved), "typical_half_ulp": 10 ** (ulp_sum / moved)}


def _lost_findings(ck: Checkpoint, prefix: str, weights: dict[str, Entry]) -> list[Finding]:
    group_of = {n: g for o in ck.optimizers for g in o.groups for n in g.get("params", [])}
    rows = []
    for name, s in _adam_slots(ck).items():
        g, we = group_of.get(name), weights.get(name)
        if g is None or we is None or we.tensor.dtype not in LOW_PRECISION or not {"exp_avg", "exp_avg_sq"} <= set(s):
            continue
        betas, lr = g.get("betas"), g.get("lr")
        if not (isinstance(betas, tuple) and isinstance(lr, float) and lr > 0):
            continue
        w, m, v = we.tensor, s["exp_avg"], s["exp_avg_sq"]
        if not (w.shape == m.shape == v.shape and m.is_floating_point() and v.is_floating_point()):
            continue
        step = s.get("step")
        step = float(step.reshape(-1)[0]) if isinstance(step, torch.Tensor) and step.numel() == 1 else None
        if step is None or not math.isfinite(step) or step < 1:
            continue
        r = _lost(w, m, v, g, step)
        if r is not None and r["fraction"] > LOST_FRAC:
            rows.append((name, str(w.dtype).removeprefix("torch."), r))
    if not rows:
        return []
    rows.sort(key=lambda x: -x[2]["fraction"])
    shown = "; ".join(f"{n} ({d}: {r['fraction']:.0%} of updated elements, typical update {r['typical_update']:.2g} "
                      f"vs half an ulp {r['typical_half_ulp']:.2g})" for n, d, r in rows[:5])
    more = f" and {len(rows) - 5} more" if len(rows) > 5 else ""
    msg = (f"{prefix}{len(rows)} low-precision parameter{'s lose' if len(rows) > 1 else ' loses'} most of Adam's "
           f"update to rounding (lr*m_hat/(sqrt(v_hat)+eps) below half an ulp of the weight, so the weight does "
           f"not change): {shown}{more}; {_FIXES}")
    ev = {"file": ck.path, "params": {n: {"dtype": d, **r} for n, d, r in rows[:20]}, "n_params": len(rows),
          "threshold_fraction": LOST_FRAC}
    return [Finding("lost_updates", "warning", ck.step, msg, ev)]


def optimizer_findings(ck: Checkpoint, prefix: str = "") -> list[Finding]:
    """``optimizer_eps_underflow`` and ``lost_updates`` for one loaded checkpoint (before its scan
    releases the tensors). `prefix` starts each message (the file's name, for a pair)."""
    if not ck.optimizers:
        return []
    weights = {e.name: e for e in ck.entries if e.role == "weight"}
    return _eps_findings(ck, prefix, weights) + _lost_findings(ck, prefix, weights)

"""Update forensics: which factor of the optimizer's update made weights NaN/Inf.

A snapshot of reason ``update`` (``Recorder(check_update=True)``) is written right after an
``optimizer.step()`` that left a parameter non-finite: it holds the step's gradients, the post-step
optimizer state and hyperparameters, and the post-update weights. Any other snapshot whose
parameters are already non-finite while it carries the optimizer state (its ``model_state`` holds the
weights before its own step, so after the update that broke them, and its state is the one that
update left) gets the same treatment.

No model code runs: the update is recomputed element-wise, in the state's dtype, from the saved
state, exactly as ``torch.optim`` computes it:

- Adam / AdamW: ``update = lr / (1 - beta1^t) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^t) + eps)``
  (``max_exp_avg_sq`` with amsgrad), ``t`` the state's ``step``; op ``adam.update`` / ``adamw.update``.
- SGD: ``update = lr * momentum_buffer`` (``lr * grad`` without momentum); op ``sgd.update``.
- Any other optimizer: no formula is known; the non-finite elements and their state are listed
  (op ``<class>.update``).

At the non-finite elements each is given the first factor that explains it: a NaN/Inf gradient
(``grad``; all other gradients exactly 0 beside it is ``clip_grad_norm_``'s signature: a clip
coefficient of 0 from an infinite total norm, and 0 * inf = NaN), NaN/Inf state (``state``), eps
rounded to 0 in the state's dtype with ``exp_avg_sq`` = 0 (``eps_flush``: 0/0 or m/0), an update past
the dtype's max (``update_overflow``), or a finite update whose sum with the weight overflows
(``weight_overflow``). Verdicts: ``underflow`` (eps flushed to 0), ``numerical_bug`` (0 * inf from
clipping, or nothing explains it), ``overflow``, ``nonfinite_input`` (the gradient or the state was
already NaN/Inf). The culprit's phase is ``optimizer`` and its module ``<optimizer: Adam>``.

Real output (``analyzer replay`` of the ``update`` snapshot of ``tests/update_runs.py``'s pure-FP16
embedding regressor, Adam at its default eps, the embedding unfrozen at step 3)::

    verdict: underflow
      the optimizer update of step 3 made 56 element(s) of 1 parameter(s) NaN/Inf (forward and backward
      not replayed: the failure is in the update): exp_avg_sq = 0 and eps = 1e-08 rounds to 0 in float16:
      0/0 at 56 elements of `emb.weight`.
    ...
    update forensics (Adam; forward and backward not replayed):
      emb.weight (float16, state float16): 56 of 64 NaN/Inf; eps_flush 56
        update = lr / (1 - beta1^t) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^t) + eps)  (lr=0.001,
        betas=[0.9, 0.999], eps=1e-08, step=1, weight_decay=0; eps in float16 = 0)
        at [0, 0]: weight nan, grad 0, exp_avg 0, exp_avg_sq 0, update nan

How to read it: each parameter's NaN/Inf elements are counted under the factor that explains them
(``grad``, ``state``, ``eps_flush``, ``update_overflow``, ``weight_overflow``, ``unexplained``), with
a few elements and every factor's value there.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from recorders import schema

from ...errors import BadInputError
from ...load import Snapshot
__all__ = ["explained_by_update", "update_applies", "update_forensics", "written_outside", "OUTSIDE_NOTE",
           "half_ulp_at_max", "verdict_of"]

_EXAMPLES = 5
_ADAM = ("Adam", "AdamW")
_FIX = "re-record the run with this amp-autopsy version"


def _get(snap: Snapshot, key: str) -> Any:
    return getattr(snap, key, None) if hasattr(snap, key) else snap.get(key)


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0


def _named_state(path: str, opt: Any) -> tuple[str, list[tuple[str, dict, dict]]]:
    """(class name, [(param name, its state, its group)]) from the snapshot's ``optimizer`` entry."""
    bad = BadInputError
    if not isinstance(opt, dict) or not isinstance(opt.get("state_dict"), dict):
        raise bad("the snapshot's 'optimizer' entry is not {'class', 'state_dict', 'param_names'}", path=path, fix=_FIX)
    sd, names = opt["state_dict"], opt.get("param_names")
    groups, state = sd.get("param_groups"), sd.get("state")
    if not (isinstance(groups, list) and isinstance(state, dict) and isinstance(names, (list, tuple))):
        raise bad("the snapshot's optimizer state_dict lacks 'state', 'param_groups' or 'param_names'",
                  path=path, fix=_FIX)
    out, i = [], 0
    for g in groups:
        pids = g.get("params") if isinstance(g, dict) else None
        if not isinstance(pids, (list, tuple)):
            raise bad("an optimizer param group has no 'params' list", path=path, fix=_FIX)
        for pid in pids:
            if i >= len(names) or not isinstance(names[i], (str, type(None))):
                raise bad("the optimizer's param_names do not match its param_groups", path=path, fix=_FIX)
            st = state.get(pid)
            if names[i] is not None:  # None: a tensor the optimizer holds that is no model parameter
                out.append((names[i], st if isinstance(st, dict) else {}, g))
            i += 1
    cls = opt.get("class")
    return (cls.rsplit(".", 1)[-1] if isinstance(cls, str) and cls else "optimizer"), out


def update_applies(snap: Snapshot) -> bool:
    """True for an ``update`` snapshot, or one whose parameters are non-finite beside optimizer state."""
    upd, opt = _get(snap, "update"), _get(snap, "optimizer")
    if snap.reason == schema.UPDATE and upd is not None:
        return True
    if not isinstance(opt, dict) or not isinstance(opt.get("param_names"), (list, tuple)):
        return False
    ms = snap.model_state or {}
    return any(_floating(ms.get(n)) and not bool(torch.isfinite(ms[n]).all())
               for n in opt["param_names"] if isinstance(n, str))


def explained_by_update(path: str, snap: Snapshot) -> bool:
    """For a snapshot that is not an ``update`` one: does the saved optimizer state explain its
    non-finite weights? When no factor does (a weight poisoned outside the optimizer, say), the
    forward/backward replay, which names the parameter as a non-finite input, is the honest answer."""
    _, factor, _ = verdict_of(update_forensics(path, snap))
    return factor not in ("", "unexplained")


def _num(v: Any) -> float | None:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _recompute(cls: str, st: dict, g: dict, grad: torch.Tensor | None, dtype: torch.dtype):
    """(update tensor in `dtype` or None, factors it read, formula text, hyperparameters, eps in dtype)."""
    lr = _num(g.get("lr"))
    if cls in _ADAM and lr is not None and _floating(st.get("exp_avg")) and _floating(st.get("exp_avg_sq")):
        betas = g.get("betas")
        betas = betas if isinstance(betas, (list, tuple)) and len(betas) == 2 else (None, None)
        b1, b2, eps, t = _num(betas[0]), _num(betas[1]), _num(g.get("eps")), _num(st.get("step"))
        # the values torch's Adam accepts (betas in [0, 1)); others, from a damaged file, get no formula
        if None not in (b1, b2, eps, t) and 0 <= b1 < 1 and 0 <= b2 < 1 and 1 <= t < math.inf:
            m = st["exp_avg"].to(dtype)
            v = st["max_exp_avg_sq" if g.get("amsgrad") and _floating(st.get("max_exp_avg_sq")) else "exp_avg_sq"]
            eps_d = torch.tensor(eps, dtype=torch.float64).to(dtype)
            with torch.no_grad():
                denom = v.to(dtype).sqrt() / math.sqrt(1 - b2 ** t) + eps_d
                upd = (lr / (1 - b1 ** t)) * m / denom
            hyper = {"lr": lr, "betas": [b1, b2], "eps": eps, "step": t, "weight_decay": _num(g.get("weight_decay"))}
            formula = "lr / (1 - beta1^t) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^t) + eps)"
            return upd, {"exp_avg": m, "exp_avg_sq": v.to(dtype), "denom": denom}, formula, hyper, float(eps_d)
    if cls == "SGD" and lr is not None:
        buf = st.get("momentum_buffer")
        src = buf if _floating(buf) else grad
        if src is not None:
            with torch.no_grad():
                upd = lr * src.to(dtype)
            hyper = {"lr": lr, "momentum": _num(g.get("momentum")), "weight_decay": _num(g.get("weight_decay"))}
            factors = {"momentum_buffer": buf.to(dtype)} if _floating(buf) else {}
            return upd, factors, "lr * momentum_buffer" if factors else "lr * grad", hyper, None
    return None, {k: v for k, v in st.items() if _floating(v)}, None, {}, None


def _classify(post: torch.Tensor, grad, upd, factors: dict, eps_d: float | None) -> dict[str, torch.Tensor]:
    """Masks of the non-finite post-update elements, each under the first factor that explains it."""
    left = ~torch.isfinite(post)
    out: dict[str, torch.Tensor] = {}

    def take(name: str, mask: torch.Tensor) -> None:
        nonlocal left
        hit = left & mask
        if bool(hit.any()):
            out[name] = hit
            left = left & ~hit

    if grad is not None and grad.shape == post.shape:
        take("grad", ~torch.isfinite(grad))
    for f in factors.values():
        if f.shape == post.shape and f is not factors.get("denom"):
            take("state", ~torch.isfinite(f))
    if upd is not None and upd.shape == post.shape:
        if eps_d == 0.0 and "exp_avg_sq" in factors:
            take("eps_flush", factors["exp_avg_sq"] == 0)
        take("update_overflow", ~torch.isfinite(upd))
        # A finite weight plus a finite update rounds past the max only as inf, and only when the
        # update is at least half an ulp of the max: a smaller one cannot have made the weight NaN/Inf.
        take("weight_overflow", torch.isinf(post) & torch.isfinite(upd) & (upd.abs() >= half_ulp_at_max(post.dtype)))
    if bool(left.any()):
        out["unexplained"] = left
    return out


def half_ulp_at_max(dtype: torch.dtype) -> float:
    """Half the gap below the dtype's max: the least |update| that can carry a finite weight past it."""
    fi = torch.finfo(dtype)
    return fi.eps * 2.0 ** (math.frexp(fi.max)[1] - 2)  # the ulp at the max is eps * 2^(exponent of max)


def _examples(mask: torch.Tensor, post, grad, factors: dict, upd) -> list[dict]:
    idx = mask.reshape(-1).nonzero()[:_EXAMPLES].reshape(-1)
    rows = []
    for i in idx.tolist():
        at = list(torch.unravel_index(torch.tensor(i), mask.shape)) if mask.dim() else []
        row = {"index": [int(a) for a in at], "weight": float(post.reshape(-1)[i])}
        if grad is not None and grad.shape == post.shape:
            row["grad"] = float(grad.reshape(-1)[i])
        for k, f in factors.items():
            if f.shape == post.shape:
                row[k] = float(f.reshape(-1)[i])
        if upd is not None and upd.shape == post.shape:
            row["update"] = float(upd.reshape(-1)[i])
        rows.append(row)
    return rows


def _clip_signature(grads: dict) -> bool:
    """Some gradient elements NaN and every finite one exactly 0: ``clip_grad_norm_`` scaled all the
    gradients by max_norm / (inf + 1e-6) = 0, and 0 * inf = NaN."""
    nan = finite_nonzero = False
    for g in grads.values():
        if _floating(g):
            nan |= bool(torch.isnan(g).any())
            finite_nonzero |= bool((torch.isfinite(g) & (g != 0)).any())
    return nan and not finite_nonzero


def _state_dtype(st: dict, post: torch.Tensor) -> torch.dtype:
    for v in st.values():
        if _floating(v) and v.shape == post.shape:
            return v.dtype
    return post.dtype


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _param_record(name: str, cls: str, st: dict, g: dict, post: torch.Tensor, grad) -> dict:
    dtype = _state_dtype(st, post)
    upd, factors, formula, hyper, eps_d = _recompute(cls, st, g, grad, dtype)
    masks = _classify(post, grad, upd, factors, eps_d)
    counts = {k: int(m.sum()) for k, m in masks.items()}
    rec = {"name": name, "dtype": _dname(post.dtype), "state_dtype": _dname(dtype), "numel": post.numel(),
           "nonfinite": int((~torch.isfinite(post)).sum()), "nan": int(torch.isnan(post).sum()),
           "factors": counts, "formula": formula, "hyperparameters": hyper, "eps_in_dtype": eps_d,
           "grad_absmax": float(grad.abs().max()) if grad is not None else None,
           "dtype_max": float(torch.finfo(dtype).max)}
    if "eps_flush" in masks:
        zero_m = masks["eps_flush"] & (factors["exp_avg"] == 0)
        rec["zero_over_zero"] = int(zero_m.sum())
        rec["m_over_zero"] = counts["eps_flush"] - rec["zero_over_zero"]
    first = next(iter(masks.values()))
    rec["examples"] = _examples(first, post, grad, {k: v for k, v in factors.items() if k != "denom"}, upd)
    rec["state"] = {k: {"dtype": _dname(v.dtype), "shape": list(v.shape)} for k, v in st.items() if _floating(v)}
    return rec


def update_forensics(path: str, snap: Snapshot) -> dict:
    """The forensics of the update that left `snap`'s parameters non-finite (see the module docstring)."""
    opt, upd = _get(snap, "optimizer"), _get(snap, "update")
    upd = upd if isinstance(upd, dict) else {}
    grads = upd.get("grads") if isinstance(upd.get("grads"), dict) else {}
    post_params = upd.get("post_params") if isinstance(upd.get("post_params"), dict) else {}
    ms = snap.model_state or {}
    if opt is None:
        cls, named = "optimizer", [(n, {}, {}) for n in (post_params or ms)]
    else:
        cls, named = _named_state(path, opt)
    params = []
    for name, st, g in named:
        post = post_params.get(name) if _floating(post_params.get(name)) else ms.get(name)
        if not _floating(post) or bool(torch.isfinite(post).all()):
            continue
        grad = grads.get(name) if _floating(grads.get(name)) else None
        params.append(_param_record(name, cls, st, g, post, grad))
    return {"optimizer": cls, "update_snapshot": snap.reason == schema.UPDATE, "params": params,
            "clip_signature": _clip_signature(grads) if grads else False, "forward_backward_replayed": False}


def verdict_of(f: dict) -> tuple[str, str, dict | None]:
    """(verdict, the factor it rests on, the parameter with the most elements of that factor)."""
    def top(factor: str) -> dict | None:
        best = max(f["params"], key=lambda p: p["factors"].get(factor, 0), default=None)
        return best if best is not None and best["factors"].get(factor, 0) > 0 else None

    for verdict, factor in (("underflow", "eps_flush"), ("numerical_bug", "grad"), ("overflow", "update_overflow"),
                            ("overflow", "weight_overflow"), ("nonfinite_input", "grad"),
                            ("nonfinite_input", "state"), ("numerical_bug", "unexplained")):
        if verdict == "numerical_bug" and factor == "grad" and not f["clip_signature"]:
            continue
        p = top(factor)
        if p is not None and factor == "unexplained" and p["formula"] is not None:
            # the recomputed update is finite there and cannot reach the max: not the optimizer's doing
            return "nonfinite_input", factor, p
        if p is not None:
            return verdict, factor, p
    return "healthy", "", None


OUTSIDE_NOTE = ("the optimizer state is finite: this weight was written outside the optimizer step (a checkpoint "
                "load, an in-place write)")


def written_outside(path: str, snap: Snapshot) -> list[str]:
    """The parameters NaN/Inf in `snap` that the recomputed optimizer update does not explain
    (its state finite, the update finite and too small to reach the dtype's max)."""
    if not update_applies(snap):
        return []
    return [p["name"] for p in update_forensics(path, snap)["params"]
            if p["formula"] is not None and set(p["factors"]) == {"unexplained"}]

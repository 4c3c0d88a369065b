"""The replay of an update snapshot: the verdict, summary and advice written from the update forensics.

``update.update_forensics`` recomputes the optimizer update from the saved state (the module doc
there says how, and shows real output); ``replay_update`` turns its counts into a ``ReplayResult``:
the factor that explains the most NaN/Inf elements picks the verdict, the parameter with the most
of them is the culprit (op ``adam.update``..., phase ``optimizer``), and the advice is that factor's.
No model code runs.
"""
from __future__ import annotations

import torch

from ...load import Snapshot
from ..result.diagnosis import Diagnosis
from ..result.records import Culprit
from ..result.replay_result import ReplayResult
from .forensics import OUTSIDE_NOTE, half_ulp_at_max, update_forensics, verdict_of
from ..verdicts.registry import AdviceLine

__all__ = ["replay_update"]


def _because(verdict: str, factor: str, p: dict, cls: str) -> str:
    n, name, sd = p["factors"].get(factor, 0), p["name"], p["state_dtype"]
    if p["formula"] is None:
        return (f"no formula is known for {cls}'s update: {p['nonfinite']} element(s) of `{name}` are NaN/Inf; "
                "their state is listed below")
    if factor == "eps_flush":
        eps = p["hyperparameters"].get("eps")
        parts = []
        if p.get("zero_over_zero"):
            parts.append(f"0/0 at {p['zero_over_zero']} elements")
        if p.get("m_over_zero"):
            parts.append(f"exp_avg/0 = inf at {p['m_over_zero']} elements")
        return (f"exp_avg_sq = 0 and eps = {eps:g} rounds to 0 in {sd}: {' and '.join(parts)} of `{name}`")
    if factor == "grad" and verdict == "numerical_bug":
        return (f"the gradient was NaN at {n} elements of `{name}` while every other gradient element was exactly 0: "
                "clip_grad_norm_ over an infinite total norm scaled all gradients by max_norm/(inf + 1e-6) = 0, "
                "and 0 * inf = NaN; the optimizer carried it into the weights")
    if factor == "update_overflow":
        return f"the update {p['formula']} exceeded {sd}'s max {p['dtype_max']:g} at {n} elements of `{name}`"
    if factor == "weight_overflow":
        return f"weight + update exceeded {p['dtype']}'s max at {n} elements of `{name}` (the update itself is finite)"
    if factor in ("grad", "state"):
        what = "gradient" if factor == "grad" else "optimizer state (exp_avg / exp_avg_sq / momentum)"
        return (f"the {what} was already NaN/Inf at {n} elements of `{name}`: the update only carried it into "
                "the weights")
    return f"the recomputed update is finite at {n} NaN/Inf elements of `{name}`: no factor explains them"


_ADVICE = {
    "underflow": ["raise eps to at least the state dtype's smallest normal (float16: 6.1e-05; e.g. eps=1e-4)",
                  "keep FP32 parameters and optimizer state and run the forward under torch.autocast "
                  "(FP32 master weights) instead of model.half()"],
    "grad": ["skip a step whose total gradient norm is non-finite (clip_grad_norm_(..., "
             "error_if_nonfinite=True), or a GradScaler, which skips such steps), then find the op that made the "
             "infinite gradient: replay that step's nonfinite_grads snapshot"],
    "unexplained": ["compare the listed state and gradients with the optimizer's update rule: an eps that rounds "
                    "to 0 in the state's dtype, or an update past the dtype's range, are the usual causes; keeping "
                    "FP32 master weights avoids both"],
    "overflow": ["lower the learning rate, or keep FP32 master weights so the update and the weight fit the dtype"],
    "outside": ["find what wrote this weight between optimizer steps: the checkpoint it was loaded from (check "
                "it with `analyzer inspect CKPT`), or an in-place write to the parameter (param.data, copy_, "
                "fill_ under torch.no_grad())"],
    "nonfinite_input": ["the NaN/Inf came into the update: replay the snapshot of the step whose backward made it "
                        "(nonfinite_grads), or restore the optimizer state from a checkpoint before it"],
}


def _advice_for(key: str, snap: Snapshot) -> tuple[AdviceLine, ...]:
    """``_ADVICE[key]``, naming a GradScaler only where one would skip the step: a run that has one,
    or FP16 autocast (FP16 parameters' gradients are refused by ``unscale_``; BF16/FP32 need none)."""
    lines = list(_ADVICE.get(key, []))
    if key == "grad" and not (snap.has_scaler or snap.amp_dtype == "float16"):
        lines = ["skip a step whose total gradient norm is non-finite (clip_grad_norm_(..., error_if_nonfinite=True) "
                 "raises on it, or call optimizer.step() only when torch.isfinite(total_norm)), then find the op that "
                 "made the infinite gradient: replay that step's nonfinite_grads snapshot"]
    return tuple(AdviceLine(text) for text in lines)


def replay_update(path: str, snap: Snapshot) -> ReplayResult:
    """A ``ReplayResult`` for an update snapshot: the forensics, no forward/backward replay."""
    f = update_forensics(path, snap)
    verdict, factor, p = verdict_of(f)
    cls = f["optimizer"]
    when = (f"the optimizer update of step {snap.step}" if f["update_snapshot"] else
            f"an optimizer update before step {snap.step} (the weights in this snapshot are already NaN/Inf)")
    n_el = sum(q["nonfinite"] for q in f["params"])
    head = (f"{when} made {n_el} element(s) of {len(f['params'])} parameter(s) NaN/Inf (forward and backward not "
            "replayed: the failure is in the update)")
    culprit = None
    if verdict == "nonfinite_input" and factor == "unexplained":
        summary = (f"`{p['name']}` is NaN/Inf at {p['nonfinite']} element(s) that the optimizer update does not "
                   f"explain: recomputed from the saved state, the update there is finite, and a finite weight plus a "
                   f"finite update is never NaN, and inf only for an update of at least "
                   f"{half_ulp_at_max(getattr(torch, p['dtype'])):.3g} (half an ulp of {p['dtype']}'s max). "
                   f"NB: {OUTSIDE_NOTE}.")
    elif p is not None:
        summary = f"{head}: {_because(verdict, factor, p, cls)}."
        op = f"{cls.lower()}.update"
        culprit = Culprit(
            op=op, overload="default", module=f"<optimizer: {cls}>", phase="optimizer", precision=p["state_dtype"],
            index=0, source=None, node=None, input_dtypes=sorted({p["state_dtype"], p["dtype"]}),
            output_dtype=p["dtype"], input_absmax=p["grad_absmax"],
            output_absmax=float("nan") if p["nan"] else float("inf"),
            output_kind="nan" if p["nan"] else "inf", custom=False,
            **({"input": f"{'grad' if factor == 'grad' else 'state'}:{p['name']}"} if verdict == "nonfinite_input"
               else {}))
    else:
        summary = "no parameter is NaN/Inf after the update: nothing to explain."
    inputs = [] if f["update_snapshot"] and factor != "unexplained" else [f"param:{q['name']}" for q in f["params"]]
    loss = snap.loss
    low = p["dtype"] if p is not None and p["dtype"] in ("float16", "bfloat16") else None
    # the update's diagnosis: its verdict, culprit and inputs (no forward or backward ran: no runs, no evidence)
    diag = Diagnosis(verdict, culprit=culprit, nonfinite_inputs=tuple(inputs),
                     scale=float(snap.scale) if snap.scale else 1.0,
                     recorded_loss=float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None,
                     scaler=snap.has_scaler, mode="parameters" if low and not snap.amp_dtype else "autocast",
                     low=low or snap.amp_dtype)
    return ReplayResult(
        diagnosis=diag, summary=summary, runs={},
        advice_lines=_advice_for("outside" if factor == "unexplained" and verdict == "nonfinite_input" else
                           factor if verdict == "numerical_bug" else verdict, snap),
        snapshot=path, step=snap.step, reason=snap.reason, device="cpu", recorded_device=str(snap.device_type),
        device_note=None, amp_dtype=snap.amp_dtype, update=f,
        precision_note=None if p is None else (f"the update was recomputed in the optimizer state's dtype "
                                               f"({p['state_dtype']}) from the saved state and hyperparameters"))

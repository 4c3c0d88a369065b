"""Fixes tried on the snapshot: re-run the failing step with each fix, and say which ones work.

``try_fixes`` takes a replay's result and re-runs the culprit's step (its precision, its loss
scale) once per fix that applies to the verdict, under the same op recorder:

- ``module_fp32``: the culprit's module with autocast off inside it and its inputs upcast;
- ``op_fp32``: the culprit op alone computed in FP32, its result cast back;
- ``bf16`` (from FP16) / ``fp32`` (from BF16): the other precision (a run replay already made
  is reused, not repeated);
- ``lower_scale``: the largest power-of-two loss scale whose backward is finite, computed from
  the per-op maxima replay already has and verified with one run;
- ``guard_clamp`` / ``guard_eps``: the input of the culprit's log, div, sqrt, rsqrt, acos or pow
  clamped away from the singular point, or moved by the dtype's eps;
- ``check_input`` (verdict ``nonfinite_input``): nothing to run; which input to look at.

Each ``Fix`` is ``verified`` (loss and every gradient finite), ``fails`` (still non-finite; the
first bad op is named) or ``not_tried`` (with the reason). ``advice_with_status`` turns the
verdict's advice and the fixes into ``Advice`` items that never recommend a failing fix.

NB: replays run forward and backward only. A fix verified here makes the step's loss and
gradients finite; the optimizer step that follows is not replayed.

Example:
    >>> from analyzer.replay import replay_snapshot
    >>> from analyzer.replay.fixes import advice_with_status, try_fixes
    >>> r = replay_snapshot(path)                                  # doctest: +SKIP
    >>> [(f.name, f.status) for f in try_fixes(path, r)]           # doctest: +SKIP
    [('module_fp32', 'verified'), ('op_fp32', 'fails'), ('bf16', 'verified')]
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import torch

from ..errors import AnalyzerError
from ..findings import json_safe
from . import _advice, _fix_hooks
from ._fix_hooks import GUARDED, ModuleNotFound
from ._origin import align, find_origin
from ._runs import LOW_PRECISION, ReplayContext, RunTrace, run_once
from .result import ReplayResult

__all__ = ["FIX_STATUSES", "Fix", "Advice", "try_fixes", "advice_with_status"]

FIX_STATUSES = ("verified", "fails", "not_tried")
ADVICE_STATUSES = ("verified", "untested")

_NO_MODULE = ("<loss_fn>", "<loss_scale>", "<autograd>", "<accumulate_grad>")
_NAMES = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32"}


@dataclass(frozen=True)
class Fix:
    """One fix tried on the failing step, and what happened.

    Attributes:
        name: stable id: ``module_fp32``, ``op_fp32``, ``bf16``, ``fp32``, ``lower_scale``,
            ``guard_clamp``, ``guard_eps`` or ``check_input``.
        title: one human line saying what the fix is.
        status: one of ``FIX_STATUSES``.
        detail: what happened, or why it was not tried.
        precision: the precision the fix was run in.
        failing_op: where it is still non-finite (status ``fails``).
        max_safe_scale: ``lower_scale`` only: the largest power-of-two loss scale found finite.
    """

    name: str
    title: str
    status: str
    detail: str
    precision: str | None = None
    failing_op: str | None = None
    max_safe_scale: float | None = None

    def __post_init__(self):
        if self.status not in FIX_STATUSES:
            raise ValueError(f"status must be one of {FIX_STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict:
        return json_safe(asdict(self))


@dataclass(frozen=True)
class Advice:
    """One thing to try. A fix that failed on the snapshot is never one.

    Attributes:
        text: the advice, one paragraph.
        status: ``verified`` (a fix tried on the snapshot made the step finite) or ``untested``.
        fix: the ``Fix.name`` it rests on, when it is one.
    """

    text: str
    status: str
    fix: str | None = None

    def __post_init__(self):
        if self.status not in ADVICE_STATUSES:
            raise ValueError(f"status must be one of {ADVICE_STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict:
        return json_safe(asdict(self))


def try_fixes(path, result: ReplayResult, *, device: str = "auto", factory: str | None = None,
              loss_fn: str | None = None, paths: tuple[str, ...] = ()) -> list[Fix]:
    """Try each fix that applies to `result`'s verdict on the step, one run each at most.

    Args:
        path: the snapshot `result` replayed.
        result: what ``replay_snapshot`` returned for it.
        device, factory, loss_fn, paths: as given to ``replay_snapshot`` (used only when
            `result` no longer holds the replay's rebuilt model).

    Returns:
        The fixes in the order tried; empty for a healthy step.
    """
    if result.verdict == "healthy" or result.culprit is None:
        return [] if result.verdict == "healthy" else [_check_input(result)]
    if result.verdict == "nonfinite_input":
        return [_check_input(result)]
    if result.culprit["phase"] not in ("forward", "backward"):  # e.g. an optimizer update (replay/update.py)
        op, where = result.culprit["op"], result.culprit["module"]
        return [Fix(name="check_input", status="not_tried",
                    title=f"change the optimizer's settings as the advice says: {op} in {where} made the NaN/Inf",
                    detail="replay recomputes the update from the saved state; it cannot re-run the optimizer "
                           "with other settings, and no fix of the forward or backward applies")]
    ctx = result.context if result.context is not None else _rebuild(path, device, factory, loss_fn, paths)
    fork = [ctx.device.index or 0] if ctx.device.type == "cuda" else []
    from ._scaler_skip import plans as exception_plans  # the exception snapshot's GradScaler-skip fix
    with torch.random.fork_rng(devices=fork):  # the caller's RNG is left as it was
        return [fix for plan in exception_plans(result) + _plan(result) if (fix := plan(ctx, result)) is not None]


def advice_with_status(result: ReplayResult, fixes: list[Fix]) -> list[Advice]:
    """The verdict's advice with each line's status; lines resting on a failed fix are dropped.

    Verified fixes come first, then the hand-written patterns recognised around the culprit
    (``log(1 - sigmoid(x))`` -> ``binary_cross_entropy_with_logits``...), then the rest, untested.
    """
    return [Advice(text, status, fix) for text, status, fix in _advice.with_status(result, fixes)]


# -- the plan per verdict --------------------------------------------------------------------------
def _plan(result: ReplayResult) -> list:
    v, c = result.verdict, result.culprit
    low = c["precision"] in LOW_PRECISION
    guards = [_guard("clamp"), _guard("eps")] if _guard_base(c) else []
    if v == "overflow":
        return [_module_fp32, _op_fp32, _switch] + ([_lower_scale] if c["phase"] == "backward" else [])
    if v == "underflow":
        return guards + [_module_fp32, _op_fp32, _switch]
    if v == "unregistered_op":
        return [_op_fp32, _module_fp32, _switch]
    if v == "loss_scale_overflow":
        return [_lower_scale, _switch]
    if v == "numerical_bug":
        return guards + ([_module_fp32, _op_fp32] if low else []) + [_switch]
    return []


def _check_input(result: ReplayResult, why: str | None = None) -> Fix:
    names = list(result.nonfinite_inputs)
    first = names[0] if names else "an input"
    kind, _, name = first.partition(":")
    what = {"param": "parameter", "buffer": "buffer", "batch": "batch entry", "state": "state entry"}.get(kind, "input")
    more = f" (and {len(names) - 1} more: {', '.join(names[1:4])})" if len(names) > 1 else ""
    where = ("an earlier step broke the weights: replay the run's earliest snapshot"
             if kind in ("param", "buffer", "state") else "check the data pipeline that built this batch")
    return Fix(name="check_input", title=f"look at the {what} {name or first}{more}, NaN/Inf before the step ran",
               status="not_tried",
               detail=why or f"no fix can be tried on a step whose input is already non-finite; {where}")


# -- running one fix -------------------------------------------------------------------------------
def _rebuild(path, device, factory, loss_fn, paths) -> ReplayContext:
    from ..load import load_snapshot
    from .replay import _context

    path = os.fspath(path)
    return _context(path, load_snapshot(path), device, factory, loss_fn, tuple(paths))


def _where(trace: RunTrace) -> str | None:
    o = find_origin(trace)
    if o is None or o.index is None:
        return None
    rec = trace.records[o.index]
    return f"{rec.name} in {rec.module} ({rec.phase})"


def _judge(result: ReplayResult, name: str, title: str, trace: RunTrace, *, note: str = "",
           **extra) -> Fix:
    prec = trace.precision
    at = f" at loss scale {trace.scale:g}" if trace.scale != 1.0 else ""
    if trace.finite:
        return Fix(name=name, title=title, status="verified", precision=prec,
                   detail=f"{'the step' if result.step is None else f'step {result.step}'} runs finite in {prec}{at}: "
                          f"loss and every gradient{note}", **extra)
    bad = _where(trace)
    why = "the loss" if not trace.forward_finite else "a gradient"
    skip = (" (GradScaler would skip the step and lower the scale)"
            if trace.forward_finite and trace.scale > 1.0 else "")
    return Fix(name=name, title=title, status="fails", precision=prec, failing_op=bad,
               detail=f"still non-finite{at}: {why}, first at {bad or 'an unrecorded op'}{skip}")


def _attempt(ctx: ReplayContext, result: ReplayResult, name: str, title: str, precision: str, scale: float,
             **kwargs) -> RunTrace | Fix:
    """One run of the step with a fix's hooks; a user-code error becomes a not_tried Fix."""
    try:
        return run_once(ctx, precision, scale, **kwargs)
    except ModuleNotFound as e:
        return Fix(name=name, title=title, status="not_tried", precision=precision,
                   detail=f"the rebuilt model has no module {e.args[0]!r}")
    except AnalyzerError as e:
        return Fix(name=name, title=title, status="not_tried", precision=precision,
                   detail=f"the step raised with this fix applied: {e.message}")


def _culprit_run(result: ReplayResult) -> tuple[str, float]:
    c = result.culprit
    t = result.culprit_trace
    return c["precision"], (t.scale if t is not None else result.scale)


def _module_fp32(ctx: ReplayContext, result: ReplayResult) -> Fix:
    c = result.culprit
    module = c["module"]
    prec, scale = _culprit_run(result)
    title = f"keep {module} in FP32 (autocast off inside it, inputs upcast)"
    if module in _NO_MODULE:
        return Fix(name="module_fp32", title=title, status="not_tried", precision=prec,
                   detail=f"the culprit runs in {module}, outside any module of the model: the loss function "
                          "counts, so compute the loss in FP32 (after the autocast block, on .float() inputs)")
    if not getattr(getattr(ctx, "mode", None), "autocast", True):
        return Fix(name="module_fp32", title=title, status="not_tried", precision=prec,
                   detail="the run trained without autocast (low-precision parameters): a module in FP32 would "
                          "need FP32 parameters, which is not tried")
    names: list[str] = []
    out = _attempt(ctx, result, "module_fp32", title, prec, scale,
                   prepare=lambda model: _fix_hooks.module_fp32(model, module, ctx.device.type, names))
    if isinstance(out, Fix):
        return out
    if len(names) > 1:  # every instance of the class, as an edit of the class would
        others = [n for n in names if n != module]
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        n = len(others)
        title = (f"keep {module} and the {n} other module{'s' if n > 1 else ''} of its class ({shown}) in FP32 "
                 "(autocast off inside them, inputs upcast)")
    return _judge(result, "module_fp32", title, out)


def _op_fp32(ctx: ReplayContext, result: ReplayResult) -> Fix:
    c = result.culprit
    prec, scale = _culprit_run(result)
    title = f"run {c['op']} in {c['module']} ({c['phase']}) alone in FP32, its result cast back to {prec}"
    if result.culprit_trace is None:
        return Fix(name="op_fp32", title=title, status="not_tried", precision=prec,
                   detail="the replay kept no trace of the culprit's run")
    if _mutates(c):
        return Fix(name="op_fp32", title=title, status="not_tried", precision=prec,
                   detail=f"{c['op']}.{c['overload']} writes into its input in place, so it cannot run in another dtype")
    out_dtype = getattr(torch, c["output_dtype"]) if c.get("output_dtype") else None
    hits: list[int] = []
    out = _attempt(ctx, result, "op_fp32", title, prec, scale,
                   op_override=_fix_hooks.op_fp32_override(c["index"], c["op"], out_dtype, hits))
    if isinstance(out, Fix):
        return out
    if not hits:
        return Fix(name="op_fp32", title=title, status="not_tried", precision=prec,
                   detail=f"this run's op #{c['index']} was not {c['op']}: the step ran different ops")
    return _judge(result, "op_fp32", title, out)


def _mutates(c) -> bool:
    ns, _, base = c["op"].partition(".")
    try:
        return bool(getattr(getattr(getattr(torch.ops, ns), base), c["overload"])._schema.is_mutable)
    except (AttributeError, RuntimeError):
        return False


def _switch(ctx: ReplayContext, result: ReplayResult) -> Fix | None:
    c = result.culprit
    prec = c["precision"]
    amp = result.amp_dtype
    frm = prec if prec in LOW_PRECISION else amp
    if frm not in LOW_PRECISION:
        return None
    name, to = ("bf16", "bfloat16") if frm == "float16" else ("fp32", "float32")
    title = f"switch from {_NAMES[frm]} to {_NAMES[to]}"
    note = "; the optimizer step, which replay does not cover, is untested"
    known = result.traces.get(to)
    if prec == "float32" and known is None:
        return Fix(name=name, title=title, status="not_tried", precision=to,
                   detail="the FP32 replay is non-finite too: no precision change can fix this step")
    if known is not None and (known.finite or not known.forward_finite or known.scale == 1.0 or to == "float32"):
        return _judge(result, name, title, known, note=note + " (the replay's own run)")
    # BF16 has FP32's range and trains without a GradScaler: its backward is judged at scale 1.
    out = _attempt(ctx, result, name, title, to, 1.0)
    return out if isinstance(out, Fix) else _judge(result, name, title, out, note=note)


def _lower_scale(ctx: ReplayContext, result: ReplayResult) -> Fix:
    prec, _ = _culprit_run(result)
    base = result.traces.get(prec)
    title = "lower the loss scale to the largest power of two whose backward is finite"
    if prec not in LOW_PRECISION or base is None:
        return Fix(name="lower_scale", title=title, status="not_tried", precision=prec,
                   detail="the failing precision is FP32, where the loss scale cannot overflow")
    if not base.forward_finite:
        return Fix(name="lower_scale", title=title, status="not_tried", precision=prec,
                   detail="the forward is non-finite, and the loss scale only scales the backward")
    peak = _backward_peak(base, result.traces.get("float32"))
    if peak is None:
        return Fix(name="lower_scale", title=title, status="not_tried", precision=prec,
                   detail="no backward op's size at scale 1 could be worked out from the replay's runs")
    limit = float(torch.finfo(getattr(torch, prec)).max)
    scale = _pow2_below(limit / peak) if peak > 0 else base.scale / 2
    scale = min(scale, base.scale / 2)
    out = _attempt(ctx, result, "lower_scale", title, prec, scale)
    if isinstance(out, Fix):
        return out
    exp = int(round(math.log2(scale)))
    fix = _judge(result, "lower_scale", f"lower the loss scale to 2**{exp} = {scale:g} (recorded: {base.scale:g})",
                 out, note=f"; the largest |backward value| at scale 1 is {peak:.3g}, {_NAMES[prec]}'s max is "
                           f"{limit:g}; GradScaler's own update is not replayed",
                 max_safe_scale=scale if out.finite else None)
    return fix


def _backward_peak(base: RunTrace, ref: RunTrace | None) -> float | None:
    """The largest |value| a low-precision backward op holds at loss scale 1.

    Backward is linear in the incoming gradient, so a value at scale s is s times its value at
    scale 1. Finite outputs of `base` are read directly; outputs that overflowed are read from the
    same op in the FP32 run `ref` (matched by ``align``).
    """
    mapping = align(base, ref) if ref is not None and ref.finite else {}
    peak, seen = 0.0, False
    for rec in base.records:
        if rec.phase != "backward" or rec.out_dtype not in (torch.float16, torch.bfloat16) or not rec.outputs:
            continue
        v = max(base.absmax[s] for s in rec.outputs)
        if math.isfinite(v):
            peak, seen = max(peak, v / base.scale), True
            continue
        j = mapping.get(rec.index)
        if j is not None and ref.records[j].outputs:
            w = max(ref.absmax[s] for s in ref.records[j].outputs)
            if math.isfinite(w):
                peak, seen = max(peak, w / ref.scale), True
    return peak if seen else None


def _pow2_below(x: float) -> float:
    """The largest power of two strictly below `x` (rounding in the low precision needs margin)."""
    k = math.floor(math.log2(x))
    return 2.0 ** (k - 1) if 2.0 ** k >= x else 2.0 ** k


def _guard_base(c) -> str | None:
    """The guarded function family of the culprit: its op in forward, its node in backward."""
    if c["phase"] == "forward":
        base = c["op"].split(".")[-1]
    else:
        node = c.get("node") or ""
        base = node.split("Backward")[0].lower() if "Backward" in node else ""
    return base if base in GUARDED else None


def _guard(kind: str):
    name = f"guard_{kind}"

    def plan(ctx: ReplayContext, result: ReplayResult) -> Fix:
        c = result.culprit
        base = _guard_base(c)
        prec, scale = _culprit_run(result)
        how = _advice.guard_expr(base, kind)
        title = f"guard {base} at {c.get('source') or 'its call'}: {how}"
        if c.get("source") is None:
            return Fix(name=name, title=title, status="not_tried", precision=prec,
                       detail="the culprit has no user source line to guard")
        if kind == "eps" and base == "acos":
            return Fix(name=name, title=title, status="not_tried", precision=prec,
                       detail="acos has no eps form; see guard_clamp")
        seen: list[int] = []
        out = _attempt(ctx, result, name, title, prec, scale,
                       prepare=lambda _m: _fix_hooks.guard_mode(GUARDED[base], base, kind, c["source"], seen))
        if isinstance(out, Fix):
            return out
        if not seen or not seen[0]:
            return Fix(name=name, title=title, status="not_tried", precision=prec,
                       detail=f"no call of {base} with a floating input was seen at {c['source']}")
        return _judge(result, name, title, out, note=f" ({seen[0]} call(s) at that line guarded)")

    return plan

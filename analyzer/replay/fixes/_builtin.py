"""The built-in fixes: how each is applied to the rebuilt model and the advice it stands for, each registered beside them.

The registry and the judging of a fixed step (``FixSpec``, ``register_fix``, ``plan``,
``run_fixes``, ``_judge``) are ``registry.py``; this module only fills ``FIXES``. The order the fixes
are tried in is ``fixes.ORDER``, whichever module registering a fix is imported first.
"""
from __future__ import annotations

import math

import torch

from . import _hooks as _fix_hooks
from ..detection._actionable import installed_line, library_of
from ._hooks import GUARDED
from ..detection._origin import align
from ..runs._runs import ReplayContext
from .registry import _NAMES, _NO_MODULE, Fix, FixSpec, _attempt, _check_input, _culprit_run, _judge, register_fix
from ..result.replay_result import ReplayResult
from ..result.trace import LOW_PRECISION, RunTrace
from ..verdicts.registry import loss_feeds_model

__all__ = ["guard_expr"]

# The verdicts the guards and the precision switches serve.
_GUARDED_VERDICTS = ("underflow", "numerical_bug", "cancellation")
_PRECISION_VERDICTS = ("overflow", "underflow", "unregistered_op", "loss_scale_overflow", "numerical_bug",
                       "cancellation")


# -- guard_clamp / guard_eps: the culprit's input clamped, or moved by eps ------------------------
def _guard_base(c) -> str | None:
    """The guarded function family of the culprit: its op in forward, its node in backward."""
    if c["phase"] == "forward":
        base = c["op"].split(".")[-1]
    else:
        node = c.get("node") or ""
        base = node.split("Backward")[0].lower() if "Backward" in node else ""
    return base if base in GUARDED else None


def guard_expr(base: str | None, kind: str) -> str:
    """The edit a guard fix stands for, as the user would write it."""
    if base == "acos":
        return "x.clamp(-1 + eps, 1 - eps) with eps = torch.finfo(x.dtype).eps"
    if base in ("div", "pow"):
        what = "the denominator" if base == "div" else "the base"
        if kind == "clamp":
            return f"{what} moved away from 0 to +-torch.finfo(x.dtype).tiny, its sign kept"
        return f"{what} + torch.finfo(x.dtype).eps, with its sign"
    return "x.clamp_min(torch.finfo(x.dtype).tiny)" if kind == "clamp" else "x + torch.finfo(x.dtype).eps"


def _guard(kind: str):
    name = f"guard_{kind}"

    def apply(ctx: ReplayContext, result: ReplayResult) -> Fix | None:
        c = result.culprit
        base = _guard_base(c)
        prec, scale = _culprit_run(result)
        how = guard_expr(base, kind)
        title = f"guard {base} at {c.get('source') or 'its call'}: {how}"
        if c.get("source") is None:
            return Fix(name=name, title=title, status="not_tried", precision=prec,
                       detail="the culprit has no user source line to guard")
        if installed_line(c["source"]):  # nobody edits site-packages: no guard is offered there
            if kind == "eps":
                return None  # guard_clamp's line already says why
            lib = library_of(c["source"])
            return Fix(name=name, title=f"guard {base}: not offered, the call is in the installed library {lib}",
                       status="not_tried", precision=prec,
                       detail=f"{base} is called from {lib}'s own code, and the culprit's innermost frame outside torch "
                              "is that library's, so no line of your code calls it: fix what feeds it instead")
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

    return apply


def _guard_line(fix: Fix, _c, _mode: str) -> str:  # "guard log at loss.py:12: x.clamp_min(...)"
    return f"{fix.title[0].upper()}{fix.title[1:]}."


register_fix(FixSpec(
    "guard_clamp", "clamp the input of the culprit's log, div, sqrt, rsqrt, acos or pow away from its singular point",
    _guard("clamp"), serves=_GUARDED_VERDICTS, line=_guard_line, applies=lambda _v, c: _guard_base(c) is not None))


register_fix(FixSpec(
    "guard_eps", "move the input of the culprit's log, div, sqrt, rsqrt or pow by the dtype's eps",
    _guard("eps"), serves=_GUARDED_VERDICTS, line=_guard_line, applies=lambda _v, c: _guard_base(c) is not None))


# -- module_fp32 / op_fp32: the culprit's module, or its op alone, in FP32 ------------------------
def _low_precision(_v: str, c) -> bool:
    return c["precision"] in LOW_PRECISION  # an FP32 culprit: no op or module to move to FP32


def _module_fp32(ctx: ReplayContext, result: ReplayResult) -> Fix:
    c = result.culprit
    module = c["module"]
    prec, scale = _culprit_run(result)
    title = f"keep {module} in FP32 (autocast off inside it, inputs upcast)"
    if module in _NO_MODULE:
        feeds = loss_feeds_model(result.culprit_trace) if module == "<loss_fn>" else None
        then = (f"and it computes the model's input itself ({feeds}), so computing the loss in FP32 would run the "
                "whole model in FP32 too" if feeds else
                "so compute the loss in FP32 (after the autocast block, on .float() inputs)")
        return Fix(name="module_fp32", title=title, status="not_tried", precision=prec,
                   detail=f"the culprit runs in {module}, outside any module of the model: the loss function "
                          f"counts, {then}")
    if not getattr(getattr(ctx, "mode", None), "autocast", True):
        return Fix(name="module_fp32", title=title, status="not_tried", precision=prec,
                   detail="the run trained without autocast (low-precision parameters): a module in FP32 would "
                          "need FP32 parameters, which is not tried")
    names: list[str] = []
    out = _attempt(ctx, result, "module_fp32", title, prec, scale,
                   prepare=lambda model: _fix_hooks.module_fp32(model, module, ctx.device.type, names))
    if isinstance(out, Fix):
        return out
    others = tuple(n for n in names if n != module) if len(names) > 1 else ()
    if others:  # every instance of the class, as an edit of the class would
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        n = len(others)
        title = (f"keep {module} and the {n} other module{'s' if n > 1 else ''} of its class ({shown}) in FP32 "
                 "(autocast off inside them, inputs upcast)")
    return _judge(result, "module_fp32", title, out, covers=others, reference=ctx.fp32_reference)


def _module_line(fix: Fix, c, _mode: str) -> str:
    which = f"`{c['module']}` and every other module of its class" if fix.covers else f"`{c['module']}`"
    return (f"Keep {which} in FP32: run its forward under torch.autocast(device_type, enabled=False) "
            "with its inputs cast by .float().")


register_fix(FixSpec(
    "module_fp32", "the culprit's module with autocast off inside it and its inputs upcast",
    _module_fp32, serves=("overflow", "underflow", "unregistered_op", "numerical_bug", "cancellation", "precision_error"),
    line=_module_line,
    applies=_low_precision))


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


def _op_line(_fix: Fix, c, _mode: str) -> str:
    return (f"Compute {c['op']} (at {c.get('source') or c['module']}) in FP32 and cast the result back: "
            "wrap the call in torch.autocast(device_type, enabled=False) with .float() inputs.")


register_fix(FixSpec(
    "op_fp32", "the culprit op alone computed in FP32, its result cast back",
    _op_fp32, serves=("overflow", "underflow", "unregistered_op", "numerical_bug", "cancellation"), line=_op_line,
    applies=_low_precision))


# -- bf16 / fp32: the other precision -------------------------------------------------------------
def _switch(name: str):
    """``bf16`` (from FP16) or ``fp32`` (from BF16): the step in the other precision."""
    def apply(ctx: ReplayContext, result: ReplayResult) -> Fix | None:
        c = result.culprit
        frm = c["precision"] if c["precision"] in LOW_PRECISION else result.amp_dtype
        if frm not in LOW_PRECISION or name != ("bf16" if frm == "float16" else "fp32"):
            return None
        return _switch_from(ctx, result, frm)
    return apply


def _switch_from(ctx: ReplayContext, result: ReplayResult, frm: str) -> Fix:
    prec = result.culprit["precision"]
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


def _by_mode(parameters: str, fsdp_param_dtype: str, autocast: str):
    """An advice line per precision mode: low-precision parameters, FSDP's param_dtype, or autocast."""
    lines = {"parameters": parameters, "fsdp_param_dtype": fsdp_param_dtype}
    return lambda _fix, _c, mode: lines.get(mode, autocast)


_bf16_line = _by_mode(
    "Train in bfloat16 instead (model.to(torch.bfloat16)): it has FP32's range and needs no loss scaling.",
    "Use MixedPrecisionPolicy(param_dtype=torch.bfloat16): it has FP32's range and needs no loss scaling.",
    "Switch to BF16 (torch.autocast(..., dtype=torch.bfloat16)); BF16 needs no GradScaler.")


register_fix(FixSpec(
    "bf16", "the step in BF16 (from FP16)", _switch("bf16"), serves=_PRECISION_VERDICTS, line=_bf16_line))


_fp32_line = _by_mode(
    "Train this model in FP32: keep its parameters float32 (no .half() / .to(torch.bfloat16)).",
    "Shard this model without a low param_dtype (MixedPrecisionPolicy(param_dtype=torch.float32)).",
    "Train this model in FP32 (no autocast).")


register_fix(FixSpec(
    "fp32", "the step in FP32 (from BF16)", _switch("fp32"), serves=_PRECISION_VERDICTS, line=_fp32_line))


# -- lower_scale: the largest power-of-two loss scale whose backward is finite --------------------
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


def _scale_line(fix: Fix, _c, mode: str) -> str:
    s = fix.max_safe_scale
    if mode == "parameters":
        return (f"Scale the loss down before backward: (loss * {s:g}).backward() (the largest power of two whose "
                f"backward of this step is finite). The gradients stay {1 / s:g}x smaller: Adam's update ignores that "
                f"(up to eps), SGD needs a {1 / s:g}x larger lr. A GradScaler cannot do this for float16 parameters "
                "(scaler.unscale_ refuses FP16 gradients).")
    return (f"Start the GradScaler at or below {s:g}: GradScaler(init_scale={s:g}) "
            "(the largest power of two whose backward of this step is finite).")


register_fix(FixSpec(
    "lower_scale", "the largest power-of-two loss scale whose backward is finite",
    _lower_scale, serves=("overflow", "loss_scale_overflow"), line=_scale_line,
    applies=lambda v, c: v == "loss_scale_overflow" or c["phase"] == "backward"))


# -- check_input: nothing to run ------------------------------------------------------------------
register_fix(FixSpec(
    "check_input", "nothing to run: which NaN/Inf input to look at", lambda _ctx, r: _check_input(r),
    serves=("nonfinite_input",), needs_model=False))

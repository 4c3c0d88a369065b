"""The built-in verdicts: each one's summary sentence and advice lines, registered beside them.

The registry itself (``Verdict``, ``register``, the summary and advice wrappers every verdict goes
through) is ``registry.py``; this module only fills it. Their order in ``VERDICTS`` is
``verdicts.ORDER``, whichever module registering a verdict is imported first.
"""
from __future__ import annotations

import math

from ..detection._magnitude import jump_sentence
from ..result.diagnosis import Diagnosis
from .registry import AdviceLine, Verdict, _finfo, _finite, _fmt, _keep_fp32, _noted, _where, from_model, register

__all__ = ["BACKEND_SWITCH", "sqrt_d_advice"]

# -- healthy ---------------------------------------------------------------------------------------
def _healthy_summary(d: Diagnosis) -> str:
    text = "No NaN/Inf in forward or backward in any replayed precision."
    if d.recorded_loss is not None and not _finite(d.recorded_loss):
        text += (f" NB: the recorded loss was {d.recorded_loss}: the failure did not reproduce "
                 "(nondeterminism, or a different device or autocast policy).")
    return text


def _healthy_advice(d: Diagnosis) -> list[AdviceLine]:
    return [AdviceLine(
        "Nothing to fix in this step as replayed. If training did fail here, compare the "
        "recorded and replayed device and loss (nondeterminism, a different device's autocast "
        "policy), and look at the optimizer step, which replay does not cover: "
        "run `analyzer report` on the run directory.")]


register(Verdict(
    "healthy", "Every replayed precision ran the step's forward and backward without a NaN/Inf.",
    summary=_noted(_healthy_summary), advice=_healthy_advice))


# -- nonfinite_input -------------------------------------------------------------------------------
def _input_summary(d: Diagnosis) -> str:
    inputs = d.nonfinite_inputs
    first = inputs[0] if inputs else "an input"
    more = f" (and {len(inputs) - 1} more)" if len(inputs) > 1 else ""
    return f"{first}{more} was already NaN/Inf before the first op ran; the step itself is not the cause."


def _broken_weights(d: Diagnosis) -> list[AdviceLine]:
    """What keeps an optimizer step from writing NaN/Inf into the weights, with the run's own tools."""
    if d.scaler:
        return [
            AdviceLine("Lower the learning rate and clip gradients (torch.nn.utils.clip_grad_norm_) after "
                       "scaler.unscale_(optimizer)."),
            AdviceLine("Make sure the optimizer steps through scaler.step(optimizer), which skips steps with "
                       "inf/NaN gradients."),
        ]
    out = [AdviceLine("Lower the learning rate and clip gradients between backward and optimizer.step() with "
                      "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=True): it "
                      "raises on a NaN/Inf total norm instead of scaling every gradient by 0 (and inf * 0 = NaN).")]
    if d.low == "float16" and d.mode == "parameters":
        out.append(AdviceLine(
            "The parameters themselves are float16 and no GradScaler ran; none can (scaler.unscale_ refuses "
            "FP16 gradients). Keep FP32 master weights: build the model in FP32 and train under "
            "torch.autocast(device_type, dtype=torch.float16) with a torch.amp.GradScaler, which skips steps "
            "with inf/NaN gradients; until then, skip optimizer.step() when the total norm is not finite."))
    elif d.low == "float16":
        how = ("FSDP computes in param_dtype=float16 and no GradScaler ran" if d.mode == "fsdp_param_dtype"
               else "This FP16 autocast run has no GradScaler")
        out.append(AdviceLine(
            f"{how}: add torch.amp.GradScaler (scaler.scale(loss).backward(), "
            "scaler.unscale_(optimizer) before clipping, scaler.step(optimizer), scaler.update()); it keeps "
            "small FP16 gradients from flushing to zero and skips steps with inf/NaN gradients."))
    else:
        prec = "BF16" if d.low == "bfloat16" else "FP32"
        out.append(AdviceLine(
            f"Skip a step whose gradients are NaN/Inf: take total = clip_grad_norm_(...) and call "
            f"optimizer.step() only when torch.isfinite(total) (a {prec} run needs no GradScaler; nothing "
            "else skips the step for you)."))
    return out


def _input_advice(d: Diagnosis) -> list[AdviceLine]:
    kinds = {i.partition(":")[0] for i in d.nonfinite_inputs}
    out = []
    if from_model(d):  # the weights were broken: the learning rate and the update are what to change
        out += [AdviceLine("The weights were already NaN/Inf: an earlier step broke them. Replay the earliest "
                           "snapshot of the run, and look at `analyzer report` for the step where grads first "
                           "blew up."),
                *_broken_weights(d)]
    if "batch" in kinds:
        out.append(AdviceLine("The batch holds NaN/Inf: check the data pipeline (assert torch.isfinite(x).all() "
                              "where batches are built) and the feature normalisation (division by a zero std)."))
    return out


register(Verdict(
    "nonfinite_input", "A parameter, buffer or batch entry the step reads was NaN/Inf before the first op ran.",
    summary=_noted(_input_summary), advice=_input_advice))


# -- overflow --------------------------------------------------------------------------------------
def _overflow_summary(d: Diagnosis) -> str:
    c = d.culprit
    limit = float(_finfo(c["precision"]).max)
    raised = c.get("raised")
    if raised:  # the op refused a value beyond the dtype's range (detection/_raised.py)
        vals = ", ".join(_fmt(v) for v in raised["values"])
        given = f" was given {vals}, beyond {c['precision']}'s max {limit:g}, and" if vals else ""
        fp32 = " The FP32 run of the step is finite." if (d.tried or {}).get("float32") else ""
        return f"{_where(c)}{given} raised {raised['error']}.{fp32}"
    shadow32 = (c.get("shadow") or {}).get("float32")
    return (f"{_where(c)} produced {c['output_kind']} from finite inputs: recomputed in FP32 from the "
            f"same inputs its largest value is {_fmt(shadow32)}, beyond {c['precision']}'s max {limit:g}."
            + jump_sentence(_jump(d)))


def _jump(d: Diagnosis):
    """The magnitude jump the ``magnitude_jump`` probe found (``probes/magnitude.py``), or None."""
    ev = d.evidence.get("magnitude_jump")
    return None if ev is None else ev.jump


def sqrt_d_advice(check: dict | None, prec: str) -> list[AdviceLine]:
    """The sqrt(head_dim) line for an attention's logits (the ``sqrt_d`` probe's check), with its numbers."""
    if check is None:
        return []
    hd, logit, scaled, top = check["head_dim"], check["logit_absmax"], check["scaled_absmax"], check["dtype_max"]
    if check["fits"]:
        return [AdviceLine(f"Divide the attention logits by sqrt(head_dim) = {math.sqrt(hd):.3g} before the matmul: "
                           "(q / math.sqrt(head_dim)) @ k.transpose(-2, -1), or use F.scaled_dot_product_attention, "
                           f"which scales for you; the largest logit, {logit:.3g} in FP32, becomes {scaled:.3g}, "
                           f"under {prec}'s max {top:g}.")]
    return [AdviceLine(f"Dividing the attention logits by sqrt(head_dim) = {math.sqrt(hd):.3g} is not enough here: the "
                       f"largest logit, {logit:.3g} in FP32, would still be {scaled:.3g}, past {prec}'s max {top:g}.",
                       checked=True)]


def _overflow_advice(d: Diagnosis) -> list[AdviceLine]:
    c = d.culprit
    module = c["module"]
    out = []
    raised = c.get("raised")
    if raised and raised["values"]:
        v = raised["values"][0]
        bound = "min" if v < 0 else "max"
        out.append(AdviceLine(f"Use a value {c['precision']} can hold: torch.finfo(x.dtype).{bound} instead of "
                              f"{_fmt(v)} (it follows the tensor's dtype under any autocast)."))
    small = d.evidence.get("small_input")  # the small_input probe (probes/small_input.py): where it became small
    if small is not None and small.cast is not None:
        out.append(AdviceLine(
            f"Keep this value in FP32 from the cast at {small.cast['source'] or small.cast['op']} to {small.op} at "
            f"{c.get('source') or c['op']} (drop that cast, or cast to torch.float32 there): {small.op} of "
            f"{small.smallest:.3g} is beyond {small.dtype}'s range.", ("region_fp32",)))
    check = d.evidence.get("sqrt_d")  # the sqrt_d probe (probes/sqrt_d.py)
    out += sqrt_d_advice(None if check is None else check.check, c["precision"])
    if c["precision"] != "bfloat16":  # else "switch to BF16" names what already failed
        out.append(AdviceLine("Switch to BF16 (torch.autocast(..., dtype=torch.bfloat16)): it has FP32's range, "
                              "so this value fits.", ("bf16",)))
    where = "the loss" if module == "<loss_fn>" else f"`{module}`"
    out.append(_keep_fp32(module, d))
    if from_model(d):  # a value of the batch or a random draw alone does not grow with training
        out.append(AdviceLine("If activations grow over training, lower the learning rate or add weight decay / "
                              f"normalisation before {where}."))
    return out


register(Verdict(
    "overflow", "An op's result from finite inputs is beyond the low precision's max, and finite in FP32.",
    summary=_noted(_overflow_summary), advice=_overflow_advice, sdpa_check=True, precision_advice=True))


# -- underflow -------------------------------------------------------------------------------------
def _underflow_summary(d: Diagnosis) -> str:
    c = d.culprit
    flush = c.get("underflow_at")
    at = f"; the zeros come from {flush['op']} in `{flush['module']}`" if flush else ""
    return (f"{_where(c)} produced {c['output_kind']}: values that are non-zero in FP32 flushed to zero "
            f"in {c['precision']}{at}, and this op turned the zeros into {c['output_kind']}.")


def _underflow_advice(d: Diagnosis) -> list[AdviceLine]:
    c = d.culprit
    prec = c["precision"]
    out = [AdviceLine(f"Add an eps that {prec} can represent (it flushes anything below "
                      f"~{_finfo(prec).smallest_normal * _finfo(prec).eps:.1g} to zero; "
                      "1e-5 as in nn.LayerNorm is safe), or clamp the value before this op: "
                      f"x.clamp_min(torch.finfo(torch.{prec}).tiny).", ("guard_eps", "guard_clamp")),
           _keep_fp32(c["module"], d)]
    if prec != "bfloat16":
        out.append(AdviceLine("Switch to BF16: its smallest normal value is ~1e-38, the same as FP32.", ("bf16",)))
    return out


register(Verdict(
    "underflow", "Values non-zero in FP32 flushed to zero in the low precision, and an op turned the zeros "
    "into NaN/Inf.",
    summary=_noted(_underflow_summary), advice=_underflow_advice, sdpa_check=True, precision_advice=True))


# -- unregistered_op -------------------------------------------------------------------------------
def _unregistered_summary(d: Diagnosis) -> str:
    c = d.culprit
    return (f"custom op {_where(c)} received {', '.join(c['input_dtypes'])} inputs under autocast and "
            f"produced {c['output_kind']}; FP32 is finite: the op is not registered with autocast.")


def _unregistered_advice(d: Diagnosis) -> list[AdviceLine]:
    c = d.culprit
    return [
        AdviceLine(f"Register the op with autocast so it runs in FP32: torch.library.register_autocast("
                   f"'{c['op'].replace('.', '::', 1)}', device_type, torch.float32), or for an autograd.Function "
                   "decorate forward with @torch.amp.custom_fwd(device_type=..., cast_inputs=torch.float32).",
                   ("op_fp32",)),
        AdviceLine("Or cast its inputs to FP32 yourself before calling it.", ("op_fp32",)),
        _keep_fp32(c["module"], d),
    ]


register(Verdict(
    "unregistered_op", "A custom op not registered with autocast ran on low-precision inputs and produced NaN/Inf.",
    summary=_noted(_unregistered_summary), advice=_unregistered_advice, fixes=("op_fp32",), precision_advice=True))


# -- loss_scale_overflow ---------------------------------------------------------------------------
def _scale_summary(d: Diagnosis) -> str:
    return (f"forward is finite; backward overflows at loss scale {d.scale:g} first at {_where(d.culprit)} "
            "and is finite at scale 1: the loss scale is too high for this step.")


def _scale_advice(d: Diagnosis) -> list[AdviceLine]:
    out = [AdviceLine(f"GradScaler skips this step and backs the scale off from {d.scale:g}; this is normal unless "
                      "it never recovers: check the scale trend with `analyzer report`."),
           AdviceLine("If it keeps happening, start lower (GradScaler(init_scale=2**10)) or reduce the loss with "
                      "mean instead of sum so gradients are smaller.", ("lower_scale",))]
    if d.culprit["precision"] != "bfloat16":
        out.append(AdviceLine("BF16 needs no loss scaling at all.", ("bf16",)))
    return out


register(Verdict(
    "loss_scale_overflow", "The forward is finite and the backward overflows at the recorded loss scale only.",
    summary=_noted(_scale_summary), advice=_scale_advice, fixes=("lower_scale",)))


# -- numerical_bug ---------------------------------------------------------------------------------
def _bug_summary(d: Diagnosis) -> str:
    c, masks = d.culprit, d.masks
    lit = c.get("literal_nonfinite")
    if (lit or masks) and not _finite(c["input_absmax"]):
        by = f"{lit['op']} in `{lit['module']}`" if lit else f"the mask {masks[0]}"
        return (f"{_where(c)} turned the NaN/Inf written on purpose by {by} "
                f"(a mask value such as -inf) into {c['output_kind']}, e.g. a softmax or logsumexp over a "
                "row whose every entry is masked; FP32 does the same: a numerical bug, not a precision problem.")
    if c["precision"] == "float32":
        return (f"{_where(c)} produced {c['output_kind']} from finite inputs in FP32 as well: "
                "a numerical bug, not a precision problem.")
    return (f"{_where(c)} produced {c['output_kind']} in {c['precision']} from finite inputs; recomputed in FP32 "
            f"from the same rounded {c['precision']} inputs it is {c['output_kind']} too, so an earlier "
            f"{c['precision']} op had already lost what it needed (the FP32 run of the step, from unrounded values, "
            "is finite) and no cancelling subtraction or flush to zero was found on the way.")


def _bug_advice(d: Diagnosis) -> list[AdviceLine]:
    c = d.culprit
    out = []
    base = c["op"].split(".")[-1]
    node = c.get("node") or ""
    if "Logsumexp" in node or base == "logsumexp":
        out.append(AdviceLine("A row whose every entry is masked has logsumexp -inf, and its backward computes "
                              "exp(-inf - -inf) = NaN even when the row is dropped from the loss "
                              "(pytorch/pytorch#31829): mask with torch.finfo(x.dtype).min instead of -inf, or "
                              "pool only rows that keep at least one entry."))
    elif c.get("literal_nonfinite") or (d.masks and not _finite(c["input_absmax"])) or "softmax" in base:
        out.append(AdviceLine("Use a finite mask value: scores.masked_fill(mask, torch.finfo(scores.dtype).min) "
                              "instead of -inf, so a fully masked row gives a uniform row instead of NaN."))
    if base in ("log", "log2", "log10") or ("Log" in node and "Logsumexp" not in node):
        out.append(AdviceLine("Clamp the argument of log (torch.log(p.clamp_min(1e-12))) or compute "
                              "log-probabilities with log_softmax instead of log(softmax(x)).", ("guard_clamp",)))
    if "Sqrt" in node or base in ("sqrt", "rsqrt"):
        out.append(AdviceLine("Add eps inside the sqrt (torch.sqrt(x + 1e-12)): its derivative at 0 is infinite.",
                              ("guard_eps",)))
    if base in ("div", "reciprocal", "rsqrt", "pow") or "Div" in node:
        out.append(AdviceLine("Add eps to the denominator or clamp it away from zero.", ("guard_eps", "guard_clamp")))
    if c.get("hidden"):
        h = c["hidden"]
        out.append(AdviceLine(f"{h['op']} in `{h['module']}` made a NaN/Inf in forward that a later op hid; guard "
                              "its input instead (e.g. torch.where on the input, not on the output), since backward "
                              "still differentiates through it."))
    if c["precision"] == "float32":
        out.append(AdviceLine("Add eps or clamp at this op. FP32 fails as well, so switching precision will not "
                              "fix it.", ("guard_clamp", "guard_eps")))
    else:
        out += [AdviceLine("Add eps or clamp at this op: the FP32 run is finite, but from the rounded "
                           f"{c['precision']} inputs this op fails even in FP32.", ("guard_clamp", "guard_eps")),
                _keep_fp32(c["module"], d)]
    return out


register(Verdict(
    "numerical_bug", "An op produced NaN/Inf that FP32 produces too from the same inputs (log(0), 0/0, a fully "
    "masked softmax): not a precision problem.",
    summary=_noted(_bug_summary), advice=_bug_advice, sdpa_check=True, precision_advice=True))


# -- kernel_specific -------------------------------------------------------------------------------
# What the advice tells the user to write, per SDPA backend.
BACKEND_SWITCH = {"flash": "SDPBackend.FLASH_ATTENTION", "mem_efficient": "SDPBackend.EFFICIENT_ATTENTION",
                  "math": "SDPBackend.MATH", "cudnn": "SDPBackend.CUDNN_ATTENTION"}


def _kernel_summary(d: Diagnosis) -> str:
    """Which op of which backend failed, and which backends are finite instead."""
    c, sdpa = d.culprit, d.sdpa
    return (f"{c['op']} in `{c['module']}` ({c['phase']}, {c['precision']}) produced {c['output_kind']} inside "
            f"scaled_dot_product_attention's {sdpa.backend} backend; the same step in {c['precision']} is "
            f"finite on the {' and '.join(sdpa.finite)} backend: the NaN depends on the attention kernel.")


def _kernel_advice(d: Diagnosis) -> list[AdviceLine]:
    """The backend switch first, then what makes the failing backend itself safe."""
    c, sdpa = d.culprit, d.sdpa
    finite = sdpa.finite
    ran, prec = sdpa.backend, c["precision"]
    out = [AdviceLine(f"Run attention on the {finite[0]} backend, where this step is finite: "
                      f"`with torch.nn.attention.sdpa_kernel({BACKEND_SWITCH.get(finite[0], finite[0])}): ...` "
                      "around the forward (from torch.nn.attention import SDPBackend).")]
    if ran == "math" and sdpa.math_reduced_precision and prec != "float32":
        out.append(AdviceLine(f"The math backend computed in {prec} because "
                              "torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True) was set: leave it off "
                              "(the default) and the math backend upcasts FP16/BF16 to FP32."))
    out.append(AdviceLine(f"To keep the {ran} backend, run attention outside autocast in FP32 "
                          "(torch.autocast(device_type, enabled=False) with q, k, v cast by .float())."))
    return out


register(Verdict(
    "kernel_specific", "The NaN/Inf happens inside one scaled-dot-product-attention backend; another backend "
    "runs the same step finite.",
    summary=_kernel_summary, advice=_kernel_advice))

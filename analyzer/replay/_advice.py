"""Plain-words summary and concrete advice for each verdict."""
from __future__ import annotations

import math

from ._patterns import patterns
from .backends import kernel_advice, kernel_summary

__all__: list[str] = []

_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38}
_TINY = {"float16": 6.0e-8, "bfloat16": 9.2e-41, "float32": 1.4e-45}


def _where(c: dict) -> str:
    src = f" at {c['source']}" if c.get("source") else ""
    node = f", {c['node']}" if c.get("node") else ""
    return f"{c['op']} in `{c['module']}` ({c['phase']}{node}, {c['precision']}){src}"


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def summary(verdict: str, c: dict | None, *, inputs: list[str] | None = None, scale: float = 1.0,
            recorded_loss: float | None = None, written_only: list[str] | None = None,
            masks: list[str] | None = None, sdpa: dict | None = None) -> str:
    if verdict == "kernel_specific":  # `sdpa`: the backend that ran and what the others did (backends.py)
        return kernel_summary(c, sdpa)
    text = _summary(verdict, c, inputs=inputs, scale=scale, recorded_loss=recorded_loss, masks=masks)
    if written_only:
        more = f" (and {len(written_only) - 1} more)" if len(written_only) > 1 else ""
        text += (f" NB: {written_only[0]}{more} is NaN/Inf in the snapshot, but this step only writes it "
                 "(a train-mode BatchNorm's running stats, saved after the forward): not a cause.")
    return text


def _summary(verdict: str, c: dict | None, *, inputs: list[str] | None, scale: float,
             recorded_loss: float | None, masks: list[str] | None) -> str:
    if verdict == "healthy":
        text = "No NaN/Inf in forward or backward in any replayed precision."
        if recorded_loss is not None and not _finite(recorded_loss):
            text += (f" NB: the recorded loss was {recorded_loss}: the failure did not reproduce "
                     "(nondeterminism, or a different device or autocast policy).")
        return text
    if verdict == "nonfinite_input":
        first = inputs[0] if inputs else "an input"
        more = f" (and {len(inputs) - 1} more)" if inputs and len(inputs) > 1 else ""
        return f"{first}{more} was already NaN/Inf before the first op ran; the step itself is not the cause."
    assert c is not None
    shadow32 = (c.get("shadow") or {}).get("float32")
    if verdict == "overflow":
        limit = _MAX.get(c["precision"], 0)
        return (f"{_where(c)} produced {c['output_kind']} from finite inputs: recomputed in FP32 from the "
                f"same inputs its largest value is {_fmt(shadow32)}, beyond {c['precision']}'s max {limit:g}.")
    if verdict == "underflow":
        flush = c.get("underflow_at")
        at = f"; the zeros come from {flush['op']} in `{flush['module']}`" if flush else ""
        return (f"{_where(c)} produced {c['output_kind']}: values that are non-zero in FP32 flushed to zero "
                f"in {c['precision']}{at}, and this op turned the zeros into {c['output_kind']}.")
    if verdict == "unregistered_op":
        return (f"custom op {_where(c)} received {', '.join(c['input_dtypes'])} inputs under autocast and "
                f"produced {c['output_kind']}; FP32 is finite: the op is not registered with autocast.")
    if verdict == "loss_scale_overflow":
        return (f"forward is finite; backward overflows at loss scale {scale:g} first at {_where(c)} "
                "and is finite at scale 1: the loss scale is too high for this step.")
    if verdict == "numerical_bug":
        lit = c.get("literal_nonfinite")
        if (lit or masks) and not _finite(c["input_absmax"]):
            by = f"{lit['op']} in `{lit['module']}`" if lit else f"the mask {masks[0]}"
            return (f"{_where(c)} turned the NaN/Inf written on purpose by {by} "
                    f"(a mask value such as -inf) into {c['output_kind']}, e.g. a softmax or logsumexp over a "
                    "row whose every entry is masked; FP32 does the same: a numerical bug, not a precision problem.")
        if c["precision"] == "float32":
            return (f"{_where(c)} produced {c['output_kind']} from finite inputs in FP32 as well: "
                    "a numerical bug, not a precision problem.")
        return (f"{_where(c)} produced {c['output_kind']} in {c['precision']} from finite inputs and "
                "is non-finite in FP32 from the same inputs, though the FP32 run stayed finite.")
    raise ValueError(verdict)


def advice(verdict: str, c: dict | None, *, inputs: list[str] | None = None, scale: float = 1.0,
           masks: list[str] | None = None, sdpa: dict | None = None,
           tried: dict[str, bool] | None = None, scaler: bool = True, mode: str = "autocast",
           low: str | None = None) -> list[str]:
    """The verdict's advice lines. `tried` (precision -> whether its replay was finite) keeps a
    line that recommends a precision only when that precision's replay was finite: it is dropped
    when that replay failed, and marked "(untested)" when there was none.

    `scaler` (whether the run had a GradScaler), `mode` (the precision mode: ``autocast``,
    ``parameters``, ``fsdp_param_dtype``) and `low` (the run's low precision, None for FP32) keep
    the advice to tools the run uses: ``scaler.unscale_`` only for a run with a GradScaler, "add a
    GradScaler" only where one would work (FP16 autocast or FSDP, not FP16 parameters, whose
    gradients ``unscale_`` refuses), "switch to BF16" not for a run already in BF16.
    """
    lines = _advice(verdict, c, inputs=inputs, scale=scale, masks=masks, sdpa=sdpa, scaler=scaler, mode=mode, low=low)
    return respect_runs([a for a in lines if a], tried)  # "": no module to keep in FP32 (_keep_fp32)


def _broken_weights(scaler: bool, mode: str, low: str | None) -> list[str]:
    """What keeps an optimizer step from writing NaN/Inf into the weights, with the run's own tools."""
    if scaler:
        return [
            "Lower the learning rate and clip gradients (torch.nn.utils.clip_grad_norm_) after scaler.unscale_(optimizer).",
            "Make sure the optimizer steps through scaler.step(optimizer), which skips steps with inf/NaN gradients.",
        ]
    out = ["Lower the learning rate and clip gradients between backward and optimizer.step() with "
           "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=True): it raises on a "
           "NaN/Inf total norm instead of scaling every gradient by 0 (and inf * 0 = NaN)."]
    if low == "float16" and mode == "parameters":
        out.append("The parameters themselves are float16 and no GradScaler ran; none can (scaler.unscale_ refuses "
                   "FP16 gradients). Keep FP32 master weights: build the model in FP32 and train under "
                   "torch.autocast(device_type, dtype=torch.float16) with a torch.amp.GradScaler, which skips steps "
                   "with inf/NaN gradients; until then, skip optimizer.step() when the total norm is not finite.")
    elif low == "float16":
        how = ("FSDP computes in param_dtype=float16 and no GradScaler ran" if mode == "fsdp_param_dtype"
               else "This FP16 autocast run has no GradScaler")
        out.append(f"{how}: add torch.amp.GradScaler (scaler.scale(loss).backward(), "
                   "scaler.unscale_(optimizer) before clipping, scaler.step(optimizer), scaler.update()); it keeps "
                   "small FP16 gradients from flushing to zero and skips steps with inf/NaN gradients.")
    else:
        prec = "BF16" if low == "bfloat16" else "FP32"
        out.append(f"Skip a step whose gradients are NaN/Inf: take total = clip_grad_norm_(...) and call "
                   f"optimizer.step() only when torch.isfinite(total) (a {prec} run needs no GradScaler; nothing "
                   "else skips the step for you).")
    return out


def _advice(verdict: str, c: dict | None, *, inputs: list[str] | None = None, scale: float = 1.0,
            masks: list[str] | None = None, sdpa: dict | None = None, scaler: bool = True,
            mode: str = "autocast", low: str | None = None) -> list[str]:
    if verdict == "kernel_specific":
        return kernel_advice(c, sdpa)
    if verdict == "healthy":
        return [
            "Nothing to fix in this step as replayed. If training did fail here, compare the "
            "recorded and replayed device and loss (nondeterminism, a different device's autocast "
            "policy), and look at the optimizer step, which replay does not cover: "
            "run `analyzer report` on the run directory.",
        ]
    if verdict == "nonfinite_input":
        out = []
        if any(i.startswith(("param:", "buffer:", "state:")) for i in inputs or []):
            out += [
                "The weights were already NaN/Inf: an earlier step broke them. Replay the earliest "
                "snapshot of the run, and look at `analyzer report` for the step where grads first blew up.",
                *_broken_weights(scaler, mode, low),
            ]
        if any(i.startswith("batch:") for i in inputs or []):
            out += [
                "The batch holds NaN/Inf: check the data pipeline (assert torch.isfinite(x).all() "
                "where batches are built) and the feature normalisation (division by a zero std).",
            ]
        return out
    assert c is not None
    module, op = c["module"], c["op"]
    keep = _keep_fp32(module)
    in_bf16 = c["precision"] == "bfloat16"  # then "switch to BF16" names what already failed
    if verdict == "overflow":
        out = []
        if _looks_like_attention(c):
            out.append("Divide the attention logits by sqrt(d): q @ k.transpose(-2, -1) / math.sqrt(head_dim), "
                       "or use F.scaled_dot_product_attention, which scales for you.")
        where = "the loss" if module == "<loss_fn>" else f"`{module}`"
        out += [
            *([] if in_bf16 else
              ["Switch to BF16 (torch.autocast(..., dtype=torch.bfloat16)): it has FP32's range, so this value fits."]),
            keep,
            "If activations grow over training, lower the learning rate or add weight decay / normalisation "
            f"before {where}.",
        ]
        return out
    if verdict == "underflow":
        prec = c["precision"]
        return [
            f"Add an eps that {prec} can represent (it flushes anything below ~{_TINY.get(prec, 0):.1g} to zero; "
            "1e-5 as in nn.LayerNorm is safe), or clamp the value before this op: "
            f"x.clamp_min(torch.finfo(torch.{prec}).tiny).",
            keep,
            *([] if in_bf16 else ["Switch to BF16: its smallest normal value is ~1e-38, the same as FP32."]),
        ]
    if verdict == "unregistered_op":
        return [
            f"Register the op with autocast so it runs in FP32: torch.library.register_autocast('{op.replace('.', '::', 1)}', "
            "device_type, torch.float32), or for an autograd.Function decorate forward with "
            "@torch.amp.custom_fwd(device_type=..., cast_inputs=torch.float32).",
            "Or cast its inputs to FP32 yourself before calling it.",
            keep,
        ]
    if verdict == "loss_scale_overflow":
        return [
            f"GradScaler skips this step and backs the scale off from {scale:g}; this is normal unless it "
            "never recovers: check the scale trend with `analyzer report`.",
            "If it keeps happening, start lower (GradScaler(init_scale=2**10)) or reduce the loss with "
            "mean instead of sum so gradients are smaller.",
            *([] if in_bf16 else ["BF16 needs no loss scaling at all."]),
        ]
    if verdict == "numerical_bug":
        out = []
        base = op.split(".")[-1]
        node = c.get("node") or ""
        if "Logsumexp" in node or base == "logsumexp":
            out.append("A row whose every entry is masked has logsumexp -inf, and its backward computes "
                       "exp(-inf - -inf) = NaN even when the row is dropped from the loss "
                       "(pytorch/pytorch#31829): mask with torch.finfo(x.dtype).min instead of -inf, or "
                       "pool only rows that keep at least one entry.")
        elif c.get("literal_nonfinite") or (masks and not _finite(c["input_absmax"])) or "softmax" in base:
            out.append("Use a finite mask value: scores.masked_fill(mask, torch.finfo(scores.dtype).min) "
                       "instead of -inf, so a fully masked row gives a uniform row instead of NaN.")
        if base in ("log", "log2", "log10") or ("Log" in node and "Logsumexp" not in node):
            out.append("Clamp the argument of log (torch.log(p.clamp_min(1e-12))) or compute log-probabilities "
                       "with log_softmax instead of log(softmax(x)).")
        if "Sqrt" in node or base in ("sqrt", "rsqrt"):
            out.append("Add eps inside the sqrt (torch.sqrt(x + 1e-12)): its derivative at 0 is infinite.")
        if base in ("div", "reciprocal", "rsqrt", "pow") or "Div" in node:
            out.append("Add eps to the denominator or clamp it away from zero.")
        if c.get("hidden"):
            h = c["hidden"]
            out.append(f"{h['op']} in `{h['module']}` made a NaN/Inf in forward that a later op hid; guard its "
                       "input instead (e.g. torch.where on the input, not on the output), since backward "
                       "still differentiates through it.")
        if c["precision"] == "float32":
            out.append("Add eps or clamp at this op. FP32 fails as well, so switching precision will not fix it.")
        else:
            out += ["Add eps or clamp at this op: the FP32 run is finite, but from the rounded "
                    f"{c['precision']} inputs this op fails even in FP32.", keep]
        return out
    raise ValueError(verdict)


def _keep_fp32(module: str) -> str:
    """Keep the culprit's module in FP32; for the loss function, compute the loss in FP32; nothing
    for the other places outside any module (``<autograd>``, ``<accumulate_grad>``), which no
    autocast region covers."""
    if module == "<loss_fn>":
        return ("Compute the loss in FP32: call the loss function on .float() inputs inside "
                "torch.autocast(device_type, enabled=False), nested in the training step's autocast block.")
    if module.startswith("<"):
        return ""
    return (f"Keep `{module}` in FP32: run it under torch.autocast(device_type, enabled=False) "
            "with its inputs cast by .float().")


def _looks_like_attention(c: dict) -> bool:
    module = c["module"].lower()
    op = c["op"].split(".")[-1]
    in_attention = ("attn" in module or "attention" in module) and op in (
        "bmm", "mm", "matmul", "baddbmm", "addmm", "einsum")
    batched_forward = op in ("bmm", "baddbmm") and c["phase"] == "forward"
    return in_attention or batched_forward


# -- advice and the fixes tried on the snapshot (replay.fixes) -------------------------------------
# The fixes each advice line recommends, by the line's opening words (the lines are written above).
_TAGS = (
    ("Switch to BF16", ("bf16",)),
    ("BF16 needs no loss scaling", ("bf16",)),
    ("Keep `", ("module_fp32",)),
    ("Add an eps that", ("guard_eps", "guard_clamp")),
    ("Clamp the argument of log", ("guard_clamp",)),
    ("Add eps inside the sqrt", ("guard_eps",)),
    ("Add eps to the denominator", ("guard_eps", "guard_clamp")),
    ("Add eps or clamp at this op", ("guard_clamp", "guard_eps")),
    ("If it keeps happening, start lower", ("lower_scale",)),
    ("Register the op with autocast", ("op_fp32",)),
    ("Or cast its inputs to FP32", ("op_fp32",)),
    # _precision.mode_advice's own lines for a run without autocast
    ("Or train in bfloat16", ("bf16",)),
    ("Or use MixedPrecisionPolicy(param_dtype=torch.bfloat16)", ("bf16",)),
)
_PRECISION_OF = {"bf16": "bfloat16", "fp32": "float32"}


def fix_tags(line: str) -> tuple[str, ...]:
    """The fix names an advice line recommends (empty: advice no replay can try)."""
    return next((tags for prefix, tags in _TAGS if line.startswith(prefix)), ())


def respect_runs(lines: list[str], tried: dict[str, bool] | None) -> list[str]:
    """Drop a line recommending a precision whose replay failed; mark it untested without one."""
    if tried is None:
        return lines
    out = []
    for line in lines:
        precs = [_PRECISION_OF[t] for t in fix_tags(line) if t in _PRECISION_OF]
        if not precs:
            out.append(line)
        elif all(tried.get(p) for p in precs):
            out.append(line)
        elif not any(p in tried for p in precs):
            out.append(f"{line} (untested)")
    return out


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


def _fix_line(fix, c, mode: str = "autocast") -> str:
    """The advice a verified fix stands for, in the terms of the run's precision mode (a run
    without autocast switches precision by its parameters' dtype, not by autocast's)."""
    name = fix.name
    if name == "module_fp32":
        which = f"`{c['module']}` and every other module of its class" if " of its class " in fix.title \
            else f"`{c['module']}`"
        return (f"Keep {which} in FP32: run its forward under torch.autocast(device_type, enabled=False) "
                "with its inputs cast by .float().")
    if name == "op_fp32":
        return (f"Compute {c['op']} (at {c.get('source') or c['module']}) in FP32 and cast the result back: "
                "wrap the call in torch.autocast(device_type, enabled=False) with .float() inputs.")
    if name == "bf16" and mode == "parameters":
        return "Train in bfloat16 instead (model.to(torch.bfloat16)): it has FP32's range and needs no loss scaling."
    if name == "bf16" and mode == "fsdp_param_dtype":
        return "Use MixedPrecisionPolicy(param_dtype=torch.bfloat16): it has FP32's range and needs no loss scaling."
    if name == "bf16":
        return "Switch to BF16 (torch.autocast(..., dtype=torch.bfloat16)); BF16 needs no GradScaler."
    if name == "fp32" and mode == "parameters":
        return "Train this model in FP32: keep its parameters float32 (no .half() / .to(torch.bfloat16))."
    if name == "fp32" and mode == "fsdp_param_dtype":
        return "Shard this model without a low param_dtype (MixedPrecisionPolicy(param_dtype=torch.float32))."
    if name == "fp32":
        return "Train this model in FP32 (no autocast)."
    if name == "lower_scale" and mode == "parameters":
        s = fix.max_safe_scale
        return (f"Scale the loss down before backward: (loss * {s:g}).backward() (the largest power of two whose "
                f"backward of this step is finite). The gradients stay {1 / s:g}x smaller: Adam's update ignores that "
                f"(up to eps), SGD needs a {1 / s:g}x larger lr. A GradScaler cannot do this for float16 parameters "
                "(scaler.unscale_ refuses FP16 gradients).")
    if name == "lower_scale":
        s = fix.max_safe_scale
        return (f"Start the GradScaler at or below {s:g}: GradScaler(init_scale={s:g}) "
                "(the largest power of two whose backward of this step is finite).")
    if name in ("guard_clamp", "guard_eps"):  # "guard log at loss.py:12: x.clamp_min(...)"
        return f"{fix.title[0].upper()}{fix.title[1:]}."
    return fix.title


def with_status(result, fixes: list) -> list[tuple[str, str, str | None]]:
    """(text, status, fix) per advice item: verified fixes, recognised patterns, the rest untested.

    A line resting only on fixes that were tried and failed is dropped; a line whose fix was
    verified is replaced by that fix's own line.
    """
    by_name = {f.name: f for f in fixes}
    c = result.culprit
    out = [(_fix_line(f, c, result.precision_mode), "verified", f.name)
           for f in fixes if f.status == "verified" and c is not None]
    out += [(text, "untested", None) for text in patterns(result)]
    tried = {p: bool(r.get("finite")) for p, r in (result.runs or {}).items()}
    for line in respect_runs(list(result.advice), tried):
        tags = fix_tags(line)
        mine = [by_name[t] for t in tags if t in by_name]
        if any(f.status == "verified" for f in mine):
            continue  # its fix's own line is already first
        if mine and all(f.status == "fails" for f in mine):
            continue
        out.append((line, "untested", mine[0].name if mine else None))
    return out

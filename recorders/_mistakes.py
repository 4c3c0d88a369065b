"""Common misuses of the Recorder, noticed once each with a ``RecorderWarning`` that says what to change.

- **A scaled loss passed to end_step.** ``rec.end_step(scaler.scale(loss))`` records loss x scale.
  The loss's autograd node is then a multiply by the scaler's scale tensor: that tensor itself
  when the graph's saved tensors are still alive, else a multiply by a tensor that needs no
  gradient whose result moved with the scale, by the scale's own factor, at a scale change (the
  scaler backs off ten or more times at the start of an FP16 run).
- **begin_step without end_step.** A step begun and never ended records nothing. Warned at the
  next ``begin_step``, or at ``close`` when no step ever ended (and no manual snapshot was taken);
  ``meta.json["steps_begun"]``
  lets the report say so when the trace is empty.
- **Autocast not active during the forward.** (Also entered inside ``model.forward``, as accelerate
  does: then a forward hook sees low-precision outputs, or parameters cast in the outputs' graph.)
  With ``amp_dtype`` FP16/BF16 (FP32 parameters, not
  FSDP2-sharded: those run in low precision without autocast), a one-time forward
  pre-hook on the root module (run outside ``torch.compile``: it splits no graph, and removing it
  costs no recompile) reads whether autocast is on for the model's device type. The first
  training forward of the first ended step is recorded in ``meta.json["autocast"]``; autocast
  off (for example ``torch.autocast("cuda")`` around a CPU model) means the run trains in FP32.

None of this touches training: it reads host-side autograd metadata and autocast flags only.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from . import schema

__all__ = ["MistakeWatch", "observe_autocast"]

_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")


def observe_autocast(device_type: str) -> dict:
    """``{"device_type", "enabled", "dtype", "active_on"}``: autocast as the forward sees it."""
    def enabled(d: str) -> bool:
        try:
            return bool(torch.is_autocast_enabled(d))
        except (RuntimeError, ValueError, TypeError):  # a device type this build does not know
            return False

    on = enabled(device_type)
    return {"device_type": device_type, "enabled": on,
            "dtype": schema.dtype_name(torch.get_autocast_dtype(device_type)) if on else None,
            "active_on": [d for d in _DEVICE_TYPES if d != device_type and enabled(d)]}


class MistakeWatch:
    """The Recorder's watch for misuse. ``warn(kind, message, step)`` issues a RecorderWarning of `kind` (a key
    of ``schema.WARNING_KINDS``, kept in meta.json); ``update_meta(**fields)`` rewrites meta.json with new
    values (both supplied by the Recorder)."""

    def __init__(self, model: torch.nn.Module, *, amp_dtype: torch.dtype | None, device_type: str,
                 scaler: torch.amp.GradScaler | None, warn: Callable[[str, str, int | None], None],
                 update_meta: Callable[..., None], sharded: bool = False):
        self.begun = 0
        self.ended = 0
        self.manual = False  # Recorder.snapshot() was called
        self._amp = schema.dtype_name(amp_dtype)
        self._device_type = device_type
        self._scaler = scaler
        self._warn, self._update_meta = warn, update_meta
        self._warned: set[str] = set()
        self._scaled_ref: tuple[float, float] | None = None  # (recorded loss, scale) of the last suspect step
        self._observed: dict | None = None
        self._handles = []
        # NB: FSDP2's MixedPrecisionPolicy and FP16/BF16 parameters train in low precision without autocast
        low = any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters())
        if amp_dtype is not None and not sharded and not low:
            # NB: on the root only, run outside torch.compile: a hook inside the model would break its
            # graph in two for the whole run, and a different fusion is different FP16 numerics
            self._handles = [model.register_forward_pre_hook(torch.compiler.disable(self._forward_pre_hook)),
                             model.register_forward_hook(torch.compiler.disable(self._forward_hook))]

    # ---------------------------------------------------------------- events from the Recorder
    def begin(self, step: int, open_step: int | None) -> None:
        """begin_step(`step`); `open_step`: the previous step, if it began and never ended."""
        self.begun += 1  # NB: the observation is kept: HF's callback begins the step from a pre-hook of its own
        if open_step is not None and self._once("end_step"):
            self._warn("end_step_missing",
                       f"amp-autopsy recorder: begin_step({step}) came before end_step() of step {open_step}, "
                       f"so step {open_step} was not recorded. Call rec.end_step(loss) with the unscaled loss "
                       "after backward and before optimizer.step() on every step", open_step)
            self._update_meta(steps_begun=self.begun)

    def end(self, step: int, loss, row: dict | None) -> None:
        """end_step(`loss`) recorded `row` for `step`."""
        self.ended += 1
        if self._handles:
            self._autocast_seen(step, loss)
        if self._scaler is not None and isinstance(loss, torch.Tensor) and row is not None \
                and "scaled_loss" not in self._warned:
            self._check_scaled(step, loss, row)

    def close(self) -> None:
        self.release()
        if self.begun and not self.ended and not self.manual and self._once("end_step"):
            self._warn("end_step_missing",
                       f"amp-autopsy recorder: begin_step ran {self.begun} time(s) but end_step() never did, so "
                       "the run directory records no steps. Call rec.end_step(loss) with the unscaled loss after "
                       "backward and before optimizer.step() on every step", None)
        self._update_meta(steps_begun=self.begun)

    def release(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---------------------------------------------------------------- the checks
    def _once(self, key: str) -> bool:
        if key in self._warned:
            return False
        self._warned.add(key)
        return True

    def _forward_pre_hook(self, module, args) -> None:
        if self._observed is None and torch.is_grad_enabled():  # a training forward, not eval
            self._observed = observe_autocast(self._device_type)

    def _forward_hook(self, module, args, output) -> None:
        """Autocast entered inside the forward (accelerate wraps ``model.forward`` in it, so the pre-hook
        saw it off): FP32 parameters gave low-precision outputs, of autocast's dtype."""
        seen = self._observed
        if seen is None or seen["enabled"] or seen.get("inside_forward") is not None:
            return
        low, graph = _low_precision_output(output)
        cast = low is None and graph is not None and _casts_parameters(graph)  # outputs cast back to FP32
        seen["inside_forward"] = low is not None or cast
        if seen["inside_forward"]:
            seen.update(enabled=True, dtype=schema.dtype_name(low) if low is not None else None)
        elif graph is not None and _compiled_graph(graph):
            seen["compiled_graph"] = True  # its casts, if any, are hidden inside the compiled graph

    def _autocast_seen(self, step: int, loss) -> None:
        seen = self._observed
        self.release()
        if seen is None:  # no forward of the model since begin_step: nothing observed
            return
        if not seen["enabled"] and isinstance(loss, torch.Tensor) and loss.grad_fn is not None \
                and _casts_parameters(loss):
            # autocast entered inside the forward (accelerate wraps model.forward in it): the graph shows
            # the parameters cast to low precision, so it was active; its dtype is not known here
            seen = {**seen, "enabled": True, "dtype": None, "inside_forward": True}
        compiled = seen.pop("compiled_graph", False) or (isinstance(loss, torch.Tensor) and loss.grad_fn is not None
                                                           and _compiled_graph(loss))
        if not seen["enabled"] and compiled and not seen["active_on"]:  # autocast on another device: still a mistake
            # a torch.compile'd forward: its casts are inside the compiled graph, and an autocast entered
            # inside the forward (accelerate's wrapper) cannot be seen from here: not known, not "off"
            seen = {**seen, "enabled": None, "dtype": None, "inside_forward": None,
                    "note": "the forward ran a compiled graph: whether autocast was on inside it is not observable"}
        self._update_meta(autocast={**seen, "step": step})
        if seen["enabled"] is None:
            return
        dt = self._device_type
        if not seen["enabled"]:
            others = seen["active_on"]
            cause = (f"autocast is active for {', '.join(others)}, not {dt}: torch.autocast({others[0]!r}) "
                     f"does nothing for a model on {dt}" if others else
                     f"no autocast region was active for {dt} (torch.autocast on another device type does "
                     "nothing here, and torch.autocast(\"cuda\") without CUDA disables itself)")
            self._warn("autocast_inactive",
                       f"amp-autopsy recorder: amp_dtype={self._amp} but autocast was not active on {dt} during "
                       f"the forward of step {step}, so this run trains in FP32: {cause}. Run the forward under "
                       f"torch.autocast(device_type={dt!r}, dtype=torch.{self._amp}), with device_type taken from "
                       "the model (next(model.parameters()).device.type), or pass amp_dtype=None for an FP32 run",
                       step)
        elif seen["dtype"] is not None and seen["dtype"] != self._amp:
            self._warn("autocast_dtype",
                       f"amp-autopsy recorder: amp_dtype={self._amp} but autocast on {dt} runs in {seen['dtype']} "
                       f"(step {step}): pass amp_dtype=torch.{seen['dtype']} so that the report and replay use the "
                       "precision this run trains in", step)

    def _check_scaled(self, step: int, loss: torch.Tensor, row: dict) -> None:
        node = loss.grad_fn
        if node is None or node.name() != "MulBackward0":
            return
        scale_t = self._scaler._scale
        certain = False
        for saved in ("_saved_other", "_saved_self"):
            try:
                certain = certain or (scale_t is not None and getattr(node, saved) is scale_t)
            except RuntimeError:  # freed by backward: decide from the values instead
                pass
        value, scale = row.get("loss"), row.get("scale")
        if not certain:
            if not any(fn is None for fn, _ in node.next_functions):  # both factors need gradients: no scale
                return
            if not (isinstance(value, float) and isinstance(scale, float) and math.isfinite(value)
                    and value != 0 and math.isfinite(scale) and scale > 0):
                return
            ref, self._scaled_ref = self._scaled_ref, (value, scale)
            if ref is None or ref[1] == scale or (ref[0] > 0) != (value > 0):
                return
            moved, factor = math.log(value / ref[0]), math.log(scale / ref[1])
            if abs(moved - factor) >= 0.5 * abs(factor):  # the loss did not follow the scale
                return
        self._warned.add("scaled_loss")
        self._warn("scaled_loss",
                   "amp-autopsy recorder: end_step() was given the scaled loss (loss x the GradScaler's scale"
                   + (f", {value:.4g} at scale {scale:g}" if isinstance(value, float) and isinstance(scale, float)
                      else "") + "), so the trace records loss x scale. Pass the unscaled loss: "
                   "scaler.scale(loss).backward(); rec.end_step(loss)", step)


def _casts_parameters(loss: torch.Tensor, most: int = 100_000) -> bool:
    """Whether the loss's autograd graph casts a leaf (a parameter) with ``_to_copy``: autocast's mark.

    NB: host-side graph metadata only (it survives backward); at most `most` nodes, once per run.
    """
    for node in _graph_nodes(loss, most):
        if node.name().startswith("ToCopyBackward") and any(
                child is not None and child.name() == "torch::autograd::AccumulateGrad"
                for child, _ in node.next_functions):
            return True
    return False


def _compiled_graph(loss: torch.Tensor, most: int = 100_000) -> bool:
    """Whether the loss's autograd graph runs through a compiled graph (AOTAutograd's
    ``CompiledFunctionBackward``), whose casts are hidden inside it. Host-side metadata only."""
    return any(node.name().startswith("CompiledFunction") for node in _graph_nodes(loss, most))


def _graph_nodes(loss: torch.Tensor, most: int):
    """The autograd nodes behind `loss`, depth first, each once, at most `most` of them."""
    stack, seen = [loss.grad_fn], set()
    while stack and len(seen) < most:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(child for child, _ in node.next_functions)


def _low_precision_output(output, most: int = 64) -> tuple[torch.dtype | None, torch.Tensor | None]:
    """(dtype of the first FP16/BF16 tensor among a forward's outputs, else None; the first output with
    an autograd graph) over tensors, tuples, lists, dicts and HF ModelOutputs, at most `most` values."""
    stack, looked, graph = [output], 0, None
    while stack and looked < most:
        cur = stack.pop()
        looked += 1
        if isinstance(cur, torch.Tensor):
            if cur.dtype in (torch.float16, torch.bfloat16):
                return cur.dtype, cur
            if graph is None and cur.grad_fn is not None:
                graph = cur
        elif isinstance(cur, dict):
            stack.extend(reversed(list(cur.values())))
        elif isinstance(cur, (list, tuple)):
            stack.extend(reversed(cur))
    return None, graph

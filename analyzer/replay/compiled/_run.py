"""One run of the replayed step with the model compiled as training compiled it (a snapshot's ``compile`` entry).

The per-op recorder cannot watch a compiled step: TorchDynamo does not compile under an active
``TorchDispatchMode`` (the step would silently run eager), and Inductor's kernels do not dispatch
per op. So a compiled run records only what decides the verdict: the loss and whether every
gradient is finite (a ``RunTrace`` with no op records), whether the step drew random numbers, and,
when watched, the first non-finite Inductor kernel (``_kernel_watch``). Each module of the entry is
compiled in place (``module.compile(...)``, names unchanged) for the run and restored to eager afterwards.

Random numbers: from the snapshot's RNG state, a compiled run draws what training's compiled step
drew (Inductor's own RNG, seeded from torch's generator), so its dropout masks are training's, not
eager's. ``same_masks=True`` compiles with ``torch._inductor.config.fallback_random``: Inductor then
calls eager's random ops, and the masks are the eager replay's.

Example:
    >>> run = compiled_once(ctx, [{"path": "", "backend": "inductor", ...}], "float16", 65536.0)  # doctest: +SKIP
    >>> run.trace.finite, run.error                                                                 # doctest: +SKIP
    (False, None)
"""
from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..runs._accumulate import micro_parts, scaled_loss, step_loss
from ..runs._precision import cast_batch, io_hooks
from ..runs._runs import ReplayContext, _nan_max, _to_device
from ..detection.backends import sdpa_switches
from ..result.trace import LOW_PRECISION, RunTrace
from ._kernel_watch import watching_kernels

__all__ = ["CompiledOnce", "compiled_once", "cannot_compile"]


@dataclass(frozen=True)
class CompiledOnce:
    """A compiled run: its trace, or the one line saying why the compiled step could not be built or run."""

    trace: RunTrace | None
    error: str | None = None
    drew_random: bool = False  # the step consumed torch's RNG (dropout masks, Inductor's seeds)
    kernels: dict | None = None  # watched runs: first, checked, graphs, unwatched, unavailable (``_kernel_watch``)
    micro_batch: int | None = None  # accumulation: the first micro-batch (0-based) after which the step was non-finite


def cannot_compile(entries: Sequence[dict], device: torch.device) -> str | None:
    """Why these entries cannot be compiled here (an unknown backend, no C++ compiler for CPU Inductor), or None."""
    try:
        from torch._dynamo import list_backends

        known = set(list_backends(exclude_tags=())) | {"inductor"}
    except Exception as e:  # noqa: BLE001 - a torch without dynamo compiles nothing
        return f"torch.compile is not available here ({type(e).__name__})"
    for e in entries:
        backend = e.get("backend") or "inductor"
        if backend not in known:
            return f"backend {backend!r} of `{e['path'] or '<model>'}` is not a torch.compile backend here"
    if device.type == "cpu" and any((e.get("backend") or "inductor") == "inductor" for e in entries):
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except Exception:  # noqa: BLE001 - torch raises RuntimeError with its own advice
            return "no C++ compiler found (CPU Inductor needs one: install g++ or set CXX)"
    return None


def _compile_kwargs(entry: dict) -> dict[str, Any]:
    """``torch.compile`` keyword arguments for one recorded entry (values torch did not expose stay default)."""
    kw: dict[str, Any] = {"backend": entry.get("backend") or "inductor"}
    if entry.get("mode") not in (None, "default"):
        kw["mode"] = entry["mode"]
    elif entry.get("options"):
        kw["options"] = dict(entry["options"])
    for key in ("dynamic", "fullgraph"):
        if entry.get(key) is not None:
            kw[key] = entry[key]
    return kw


@contextlib.contextmanager
def compiled_in_place(model: torch.nn.Module, entries: Sequence[dict],
                      disable: str | None = None) -> Iterator[None]:
    """Within: each entry's module compiled in place; `disable` (a module path) runs eager under
    ``torch.compiler.disable``. The model is eager again afterwards, with dynamo's caches reset."""
    torch._dynamo.reset()  # NB: dynamo caches per code object; every run compiles exactly its own set
    compiled: list[torch.nn.Module] = []
    off: torch.nn.Module | None = None
    try:
        for e in entries:
            module = model.get_submodule(e["path"])
            module.compile(**_compile_kwargs(e))
            compiled.append(module)
        if disable is not None:
            off = model.get_submodule(disable)
            off.forward = torch.compiler.disable(off.forward)  # an instance attribute over the class's forward
        yield
    finally:
        for module in compiled:
            module._compiled_call_impl = None  # what nn.Module.compile set: eager calls again
        if off is not None:
            del off.forward
        torch._dynamo.reset()


def compiled_once(ctx: ReplayContext, entries: Sequence[dict], precision: str, scale: float, *,
                  disable: str | None = None, watch: bool = False, same_masks: bool = False) -> CompiledOnce:
    """The step with `entries` compiled (the rest eager), in `precision`, backward from ``loss * scale``.

    `watch` checks each Inductor kernel's outputs (``_kernel_watch``: reads only, the numerics are
    unchanged); `same_masks` draws eager's random numbers (see the module doc). A compile or
    kernel-build failure (Inductor cannot build the kernels, no C++ compiler) and an error of the
    user's code under compilation both come back as ``error``, one line.
    """
    why = cannot_compile(entries, ctx.device)
    if why is not None:
        return CompiledOnce(None, why)
    out, built = _run(ctx, entries, precision, scale, disable, watch, same_masks, fresh=False)
    if not built and not watch:
        # NB: Inductor's FX graph cache does not key on the ATen CPU capability: a graph generated under
        # AVX-512 and reused under ATEN_CPU_CAPABILITY=default fails to build (its C++ uses at::vec). Once
        # more with the code generated afresh; a watched run generates afresh already.
        out, _ = _run(ctx, entries, precision, scale, disable, watch, same_masks, fresh=True)
    return out


def _run(ctx: ReplayContext, entries: Sequence[dict], precision: str, scale: float, disable: str | None,
         watch: bool, same_masks: bool, *, fresh: bool) -> tuple[CompiledOnce, bool]:
    """One compiled run, and False when the compiler (not the user's code) failed; `fresh`: no cached graphs."""
    model = ctx.build_model(precision)
    batch = cast_batch(_to_device(ctx.batch, ctx.device), ctx.mode, precision)
    ctx.restore_rng()
    low = precision in LOW_PRECISION
    handles = io_hooks(model, ctx.mode, precision)
    watched = watching_kernels() if watch else contextlib.nullcontext()
    values: list[float] = []
    first_bad: int | None = None
    try:
        with watched as kernels, _fresh(fresh), _random(same_masks), compiled_in_place(model, entries, disable), \
                sdpa_switches(ctx.sdpa, device=ctx.device.type):
            for i, (part, divisor) in enumerate(micro_parts(ctx.micro, batch)):  # one part unless accumulating
                with torch.autocast(ctx.device.type, dtype=getattr(torch, precision), enabled=low and ctx.mode.autocast):
                    loss = ctx.loss_fn(model, part)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    return CompiledOnce(None, "the compiled step's loss_fn returned no scalar tensor"), True
                backward_ran = loss.requires_grad
                if backward_ran:
                    scaled_loss(loss, scale, divisor).backward()
                values.append(float(loss.detach().float().item()))  # NB: sync, once per micro-batch
                if first_bad is None and ctx.micro is not None and not (math.isfinite(values[-1]) and _grads_finite(model)):
                    first_bad = i
    except Exception as e:  # noqa: BLE001 - Inductor's build errors are many types; each is one line
        return CompiledOnce(None, _why_failed(e)), not _by_compiler(e)
    finally:
        for h in handles:
            h.remove()
        gc.collect()
    drew = _drew_random(ctx)
    vals = _grad_absmax(model)
    trace = RunTrace(
        precision=precision, scale=scale, records=[], absmax=[], nonzero=[],
        loss=step_loss(ctx.micro, values), loss_dtype=str(loss.dtype).removeprefix("torch."),
        loss_producer=None, grads_finite=all(math.isfinite(v) for v in vals),
        grad_absmax=_nan_max(vals) / scale if vals else None,
        backward_ran=backward_ran)
    seen = None if kernels is None else {"first": kernels.first, "checked": kernels.checked,
                                         "graphs": kernels.graphs, "unwatched": kernels.unwatched,
                                         "unavailable": kernels.unavailable}
    return CompiledOnce(trace, drew_random=drew, kernels=seen, micro_batch=first_bad), True


def _grad_absmax(model: torch.nn.Module) -> list[float]:
    """abs-max of every floating gradient (0 for others); NB: syncs."""
    grads = [p.grad for p in model.parameters() if p.grad is not None and p.grad.numel() > 0]
    return [float(g.detach().abs().amax().float()) if g.is_floating_point() else 0.0 for g in grads]


def _grads_finite(model: torch.nn.Module) -> bool:
    return all(math.isfinite(v) for v in _grad_absmax(model))


@contextlib.contextmanager
def _fresh(fresh: bool) -> Iterator[None]:
    """Within (when `fresh`): Inductor generates every graph's code afresh, its FX graph and AOTAutograd caches off."""
    if not fresh:
        yield
        return
    from torch._functorch import config as functorch_config
    from torch._inductor import config

    with config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def _random(same_masks: bool) -> contextlib.AbstractContextManager:
    """Inductor's own RNG (as training compiled it), or eager's random ops (``fallback_random``)."""
    if not same_masks:
        return contextlib.nullcontext()
    from torch._inductor import config

    return config.patch(fallback_random=True)


def _drew_random(ctx: ReplayContext) -> bool:
    """Whether the run consumed torch's RNG: its state differs from the snapshot's (restored before the run)."""
    if not torch.equal(torch.get_rng_state(), ctx.rng["cpu"]):
        return True
    cuda = ctx.rng.get("cuda")
    if ctx.device.type == "cuda" and cuda and len(cuda) == torch.cuda.device_count():
        return any(not torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), cuda))
    return False


def _by_compiler(e: BaseException) -> bool:
    return type(e).__module__.startswith(("torch._dynamo", "torch._inductor"))


def _why_failed(e: BaseException) -> str:
    """One line: the compiler could not build the step (its own error inside), or the step raised."""
    if _by_compiler(e):
        inner = getattr(e, "inner_exception", None) or e.__cause__ or e
        return f"torch.compile could not build the step here ({type(inner).__name__}: {_line(inner)})"
    return f"the compiled step raised {type(e).__name__}: {_line(e)}"


def _line(e: BaseException) -> str:
    """The first non-empty line of `e`, short (Inductor's messages run to pages of generated code)."""
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()[:200]
    return type(e).__name__

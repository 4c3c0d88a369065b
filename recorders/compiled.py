"""torch.compile'd models: the original module behind ``OptimizedModule``, names without ``_orig_mod.``, and how it was compiled.

``torch.compile(model)`` returns an ``OptimizedModule`` whose ``named_parameters()`` and
``state_dict()`` carry the prefix ``_orig_mod.``; ``model.norm = torch.compile(model.norm)``
puts ``norm._orig_mod.`` inside the names. ``module.compile()`` compiles in place and keeps
the names. The recorder records under the original names (``clean_name``) and writes
``compile_info`` to meta.json and every snapshot (key ``compile``, since format version 5).

Example:
    >>> import torch
    >>> m = torch.compile(torch.nn.Linear(2, 2), backend="aot_eager")
    >>> unwrap(m) is m._orig_mod, clean_name("_orig_mod.weight")
    (True, 'weight')
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["ORIG_MOD", "unwrap", "clean_name", "clean_state", "compile_info"]

ORIG_MOD = "_orig_mod"


def _optimized_module_type() -> type | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # noqa: BLE001 - a torch without dynamo has no compiled modules
        return None
    return OptimizedModule


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The original module behind any number of ``torch.compile`` wrappers (`model` itself if none)."""
    opt = _optimized_module_type()
    while opt is not None and isinstance(model, opt) and isinstance(getattr(model, ORIG_MOD, None), torch.nn.Module):
        model = getattr(model, ORIG_MOD)
    return model


def clean_name(name: str) -> str:
    """`name` without the ``_orig_mod`` path segments that ``torch.compile`` wrappers add."""
    if ORIG_MOD not in name:
        return name
    return ".".join(part for part in name.split(".") if part != ORIG_MOD)


def clean_state(state: dict[str, Any]) -> dict[str, Any]:
    """`state` (a state_dict) with every key through `clean_name`; `state` itself when no key changes."""
    if not any(ORIG_MOD in k for k in state):
        return state
    return {clean_name(k): v for k, v in state.items()}


def _backend_info(callback: Any) -> dict[str, Any]:
    """backend, mode, dynamic and Inductor options from a dynamo callback (torch 2.x internals)."""
    backend = callback
    for _ in range(16):  # ConvertFrame -> ConvertFrameAssert -> WrapBackendDebug -> the user's backend
        inner = getattr(backend, "_torchdynamo_orig_backend", None)
        if inner is None:
            break
        backend = inner
    out: dict[str, Any] = {"backend": None, "mode": None, "options": None}
    if type(backend).__name__ == "_TorchCompileInductorWrapper":
        out["backend"] = "inductor"
        config = dict(getattr(backend, "config", {}) or {})
        out["mode"] = _mode_of(config)
        if out["mode"] is None and config:
            out["options"] = {k: v for k, v in config.items() if isinstance(v, (bool, int, float, str, type(None)))}
    elif hasattr(backend, "compiler_name"):
        out["backend"] = str(backend.compiler_name)
    else:
        name = getattr(backend, "__name__", None) or type(backend).__name__
        out["backend"] = str(name)
    return out


def _mode_of(config: dict) -> str | None:
    """The ``torch.compile`` mode whose Inductor options are exactly `config` ("default" for none)."""
    if not config:
        return "default"
    try:
        from torch._inductor import list_mode_options
    except Exception:  # noqa: BLE001
        return None
    for mode in ("reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        try:
            if list_mode_options(mode) == config:
                return mode
        except Exception:  # noqa: BLE001
            return None
    return None


def _context_info(ctx: Any, callback: Any) -> dict[str, Any]:
    info = _backend_info(callback)
    dynamic = getattr(ctx, "_dynamic", None)
    fullgraph = getattr(ctx, "fullgraph", None)
    info["dynamic"] = dynamic if isinstance(dynamic, bool) else None
    info["fullgraph"] = bool(fullgraph) if isinstance(fullgraph, bool) else None
    return info


def _in_place(module: torch.nn.Module) -> dict[str, Any] | None:
    """How ``module.compile(...)`` compiled `module`, or None when it was not compiled in place."""
    fn = module.__dict__.get("_compiled_call_impl")
    if fn is None:
        return None
    info: dict[str, Any] = {"backend": None, "mode": None, "options": None, "dynamic": None, "fullgraph": None}
    try:
        nonlocals = inspect.getclosurevars(fn).nonlocals
        info = _context_info(nonlocals.get("self"), nonlocals.get("callback"))
    except Exception:  # noqa: BLE001 - torch internals vary; the module is still marked compiled
        pass
    return info


def compile_info(model: torch.nn.Module) -> dict[str, Any] | None:
    """How `model` (as the loop passed it) was compiled: None when no part of it was.

    ``{"modules": [{"path": "" for the whole model | "layers.0" (a clean module path),
    "how": "torch.compile" (an OptimizedModule wrapper) | "module.compile" (in place),
    "backend": "inductor" | "aot_eager" | ..., "mode": "default" | "reduce-overhead" | ... | None,
    "dynamic": bool | None, "fullgraph": bool | None, "options": {Inductor option: value} | None}]}``.
    Values torch does not expose are None.
    """
    opt = _optimized_module_type()
    entries: list[dict[str, Any]] = []
    wrapped: set[tuple[int, str]] = set()  # (module, path) inside a wrapper seen so far (parents come first)
    for path, module in model.named_modules(remove_duplicate=False):
        clean = clean_name(path)
        if opt is not None and isinstance(module, opt):
            try:
                info = _context_info(module.dynamo_ctx, module.dynamo_ctx.callback)
            except Exception:  # noqa: BLE001
                info = {"backend": None, "mode": None, "options": None, "dynamic": None, "fullgraph": None}
            entries.append({"path": clean, "how": "torch.compile", **info})
            wrapped.add((id(getattr(module, ORIG_MOD, module)), clean))
        elif (id(module), clean) not in wrapped:
            # NB: a module compiled in place and also wrapped (accelerate 1.16's compile_regions does both to
            # each block) runs as the wrapper's graph: Dynamo traces through the inner compile, whose backend
            # never runs (tested). So only the wrapper is what ran.
            info = _in_place(module)
            if info is not None:
                entries.append({"path": clean, "how": "module.compile", **info})
    if not entries:
        return None
    return {"modules": entries}

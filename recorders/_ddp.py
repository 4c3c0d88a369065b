"""DistributedDataParallel support of the Recorder: what shapes DDP's gradient all-reduce.

DDP replicates the model: every rank holds whole parameters and, in backward, DDP's C++ reducer
all-reduces each bucket of gradients. What changes the numbers of that sum is recorded in
meta.json's and the snapshots' ``ddp`` entry (``schema.DDP_KEYS``):

- the registered communication hook. torch's built-in ones (``default_hooks.allreduce_hook``,
  ``fp16_compress_hook``, ``bf16_compress_hook``, and the C++ ``BuiltinCommHookType`` ALLREDUCE and
  FP16_COMPRESS) are named; any other is ``"unknown"`` (one RecorderWarning). No hook: DDP's own
  all-reduce, in the gradients' dtype.
- the dtype of the sum (``reduce_dtype``: FP16/BF16 under the compress hooks, else the gradients') and
  where the division by the world size happens: ``"before"`` the sum in DDP's reducer and in each of
  torch's built-in hooks (``_allreduce_fut`` and ``_compress_hook`` divide, then all-reduce).
- ``gradient_as_bucket_view``, ``broadcast_buffers``, the bucket size and DDP's own (private)
  ``mixed_precision`` config.

The Recorder finds the DDP wrapper when it is given one, or, given the wrapped module, during the
first forward (DDP names itself the active module while it runs the wrapped module's forward).
Everything here reads DDP defensively: an attribute that moved between torch versions gives
``"unknown"``, never an exception in the training loop.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from . import schema

__all__ = ["DdpWatch", "ddp_entry", "find_ddp"]

# the names DDP's logger gives torch's built-in hooks -> (hook name, reduce dtype, where the division by world size is)
_BUILTIN_HOOKS: dict[str, tuple[str, str | None]] = {
    "allreduce_hook": ("allreduce_hook", None),
    "fp16_compress_hook": ("fp16_compress_hook", "float16"),
    "bf16_compress_hook": ("bf16_compress_hook", "bfloat16"),
    # the C++ hooks of DDP._register_builtin_comm_hook: the same numerics as the Python ones
    "BuiltinCommHookType.ALLREDUCE": ("allreduce_hook", None),
    "BuiltinCommHookType.FP16_COMPRESS": ("fp16_compress_hook", "float16"),
}


def _ddp_class() -> type | None:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except Exception:  # noqa: BLE001 - a build without torch.distributed
        return None
    return DistributedDataParallel


def find_ddp(model: Any) -> Any | None:
    """`model` itself when it is a ``DistributedDataParallel``, else None."""
    cls = _ddp_class()
    return model if cls is not None and isinstance(model, cls) else None


def _python_hook(ddp: Any) -> Callable | None | bool:
    """The one Python hook registered with ``register_comm_hook`` (partials unwrapped), None when none,
    False when DDP's (private) list of hooks cannot be read."""
    hooks = getattr(ddp, "_comm_hooks", None)
    if not isinstance(hooks, list):
        return False
    if not hooks:
        return None
    hook = hooks[-1][0] if isinstance(hooks[-1], tuple) and hooks[-1] else hooks[-1]
    while isinstance(hook, functools.partial):
        hook = hook.func
    return hook


def _hook(ddp: Any) -> tuple[str | None, str | None, str | None]:
    """(``comm_hook``, ``comm_hook_name``, ``reduce_dtype``) of `ddp`; ``comm_hook`` ``"unknown"`` when
    it is not one of torch's built-in hooks or cannot be read."""
    try:
        logged = ddp._get_ddp_logging_data().get("comm_hook")  # NB: private; the name DDP's logger keeps
    except Exception:  # noqa: BLE001 - a method that moved: unknown
        return "unknown", None, None
    name = logged if isinstance(logged, str) and logged else None
    fn = _python_hook(ddp)
    if fn is False:
        return "unknown", name, None
    if name is None and fn is None:
        return None, None, None  # no hook: DDP's reducer all-reduces in the gradients' dtype
    known = _BUILTIN_HOOKS.get(name or "")
    if known is None:
        return "unknown", name or getattr(fn, "__qualname__", None), None
    if fn is not None:  # a Python hook of that name must be torch's own function, not a user's namesake
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        if fn is not getattr(default_hooks, known[0], None):
            return "unknown", name, None
    return known[0], name, known[1]


def _mixed_precision(ddp: Any) -> dict[str, str | None] | None:
    mp = getattr(ddp, "mixed_precision", None)
    if mp is None:
        return None
    return {k: schema.dtype_name(getattr(mp, k, None)) for k in ("param_dtype", "reduce_dtype", "buffer_dtype")}


def _world_size(ddp: Any) -> int | None:
    try:
        size = ddp.process_group.size()
    except Exception:  # noqa: BLE001 - no group object: unknown
        return None
    return int(size) if isinstance(size, int) else None


def ddp_entry(ddp: Any) -> dict[str, Any]:
    """The ``ddp`` entry of meta.json and snapshots for the DDP wrapper `ddp` (``schema.DDP_KEYS``)."""
    hook, name, dtype = _hook(ddp)
    cap = getattr(ddp, "bucket_bytes_cap", None)
    mp = _mixed_precision(ddp)
    if hook is None and mp is not None:
        hook = "unknown"  # DDP's mixed_precision registers its own hook

    def flag(key: str) -> bool | None:
        value = getattr(ddp, key, None)
        return value if isinstance(value, bool) else None

    return {"world_size": _world_size(ddp), "comm_hook": hook, "comm_hook_name": name,
            "reduce_dtype": dtype, "divide": None if hook == "unknown" else "before",
            "gradient_as_bucket_view": flag("gradient_as_bucket_view"),
            "broadcast_buffers": flag("broadcast_buffers"),
            "bucket_cap_bytes": int(cap) if isinstance(cap, int) else None,
            "find_unused_parameters": flag("find_unused_parameters"), "mixed_precision": mp}


class DdpWatch:
    """The Recorder's view of the DDP wrapper around its model, if any.

    `warn(kind, message)` issues a RecorderWarning; `changed(entry)` rewrites meta.json's ``ddp`` entry,
    called when the entry read at the first forward or at a snapshot differs from meta.json's.
    """

    def __init__(self, model: torch.nn.Module, warn: Callable[[str, str], None],
                 changed: Callable[[dict], None]) -> None:
        self._ddp = find_ddp(model)
        self._warn, self._changed, self._warned = warn, changed, False
        self._published: dict | None = None  # the entry meta.json holds
        self._handle = None
        if _ddp_class() is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            # NB: loops register the hook after wrapping (often after making the Recorder): read again then
            self._handle = model.register_forward_pre_hook(self._first_forward)

    def _first_forward(self, module: torch.nn.Module, args: Any) -> None:
        """Once: the DDP wrapper that runs `module`'s forward, if one does, and its hook as it is now."""
        self.remove()
        try:
            if self._ddp is None:
                active = getattr(_ddp_class(), "_active_ddp_module", None)  # NB: private; set in DDP's forward
                if active is not None and getattr(active, "module", None) is module:
                    self._ddp = active
            self.entry()
        except Exception:  # noqa: BLE001 - never take training down
            pass

    def published(self) -> dict | None:
        """The entry for meta.json at the start: None without a DDP wrapper given."""
        self._published = self.entry(publish=False)
        return self._published

    def entry(self, publish: bool = True) -> dict[str, Any] | None:
        """The ``ddp`` entry now (a hook may be registered after the Recorder was made), None without DDP.

        `publish`: when it differs from meta.json's, ``changed(entry)`` rewrites meta.json.
        """
        if self._ddp is None:
            return None
        try:
            entry = ddp_entry(self._ddp)
        except Exception:  # noqa: BLE001 - an unfamiliar DDP object
            entry = dict.fromkeys(schema.DDP_KEYS)
            entry["comm_hook"] = "unknown"
        if entry["comm_hook"] == "unknown" and not self._warned:
            self._warned = True
            self._warn("ddp_comm_hook", "amp-autopsy recorder: DDP's communication hook "
                       f"({entry['comm_hook_name'] or 'unreadable'}) is not one of torch's built-in hooks "
                       "(allreduce_hook, fp16_compress_hook, bf16_compress_hook): its numerics are recorded as "
                       "'unknown', and the distributed replay refuses to guess them")
        if publish and entry != self._published:
            self._published = entry
            self._changed(entry)
        return entry

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

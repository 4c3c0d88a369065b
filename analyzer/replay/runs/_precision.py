"""Precision modes: what "the precision under test" means when a snapshot's step is replayed.

A run can be low-precision in three ways, and each needs its own FP32 counterpart:

- ``autocast``: FP32 parameters, ``torch.autocast(dtype)`` around the forward (the AMP recipe).
  Low-precision runs replay under autocast; the FP32 run turns autocast off.
- ``parameters``: the parameters themselves are float16/bfloat16 (``model.half()``, pure-BF16
  fine-tuning) and no autocast ran. Low-precision runs keep every tensor recorded in low
  precision in that dtype (or cast it to the other low dtype asked for with ``--dtypes``); the
  FP32 run upcasts a copy of those parameters, floating buffers and batch leaves to float32.
  Tensors recorded in FP32 (a norm kept in FP32) stay FP32 in every run. No autocast anywhere.
- ``fsdp_param_dtype``: FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``. Low-precision runs
  cast the (FP32, consolidated) parameters to ``param_dtype`` for compute, cast the floating
  inputs of the model's forward to ``param_dtype`` (``cast_forward_inputs``, FSDP's default)
  and its floating outputs to ``output_dtype`` when the policy sets one. Buffers are not cast
  (FSDP does not manage buffers). The FP32 run is the unsharded model as stored.

NB: what ``fsdp_param_dtype`` does not emulate: the casts happen at the root module only, not at
every ``fully_shard``-ed submodule's boundary (with every parameter in ``param_dtype`` an inner
input is already in ``param_dtype`` unless the model upcasts on purpose); gradients are not
reduced across ranks in ``reduce_dtype``: the replayed gradient is this rank's own, computed in
``param_dtype``, never summed with the other ranks' (their batches are in their own snapshots).

Example:
    >>> mode = precision_mode("snap.pt", snap, amp=None)  # doctest: +SKIP
    >>> mode.kind, mode.dtype                               # doctest: +SKIP
    ('parameters', 'float16')
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from recorders import schema

from ...errors import BadInputError
from ._tree import map_tensors

__all__ = ["MODES", "PrecisionMode", "precision_mode", "cast_model", "cast_batch", "io_hooks"]

MODES = ("autocast", "parameters", "fsdp_param_dtype")
_LOW = ("float16", "bfloat16")


@dataclass(frozen=True)
class PrecisionMode:
    """How this snapshot's step is replayed in low precision.

    Attributes:
        kind: one of ``MODES``.
        dtype: the low precision the run trained in (the autocast dtype, the parameters' dtype,
            or FSDP's ``param_dtype``); None for an FP32 run.
        output_dtype: FSDP's ``output_dtype`` (None: outputs are not cast).
        low_names: in ``parameters`` mode, the state entries recorded in float16/bfloat16: the
            tensors that follow the precision of each run.
        sharded: the step runs sharded across ranks (``replay.distributed``): the policy at every
            ``fully_shard``-ed module, gradients reduced in the recorded ``reduce_dtype``.
    """

    kind: str = "autocast"
    dtype: str | None = None
    output_dtype: str | None = None
    low_names: frozenset[str] = field(default_factory=frozenset)
    sharded: bool = False

    @property
    def autocast(self) -> bool:
        """Whether low-precision runs replay under ``torch.autocast``."""
        return self.kind == "autocast"

    def describe(self) -> str:
        """One line for the text report: which precision ran, and how."""
        if self.kind == "parameters":
            return (f"precision mode: parameters (the model trained with {self.dtype} parameters and no "
                    f"autocast; the FP32 run upcasts a copy of them)")
        if self.kind == "fsdp_param_dtype":
            out = f", outputs cast to {self.output_dtype}" if self.output_dtype else ""
            where = ("at every fully_shard-ed module as recorded; gradients reduced across ranks in the recorded "
                     "reduce_dtype" if self.sharded else "; gradients not reduced across ranks")
            return (f"precision mode: fsdp_param_dtype (FSDP MixedPrecisionPolicy: parameters and forward "
                    f"inputs cast to {self.dtype} for compute{out}{' ' if self.sharded else ''}{where})")
        return f"precision mode: autocast ({self.dtype or 'none'})"


def _name_of(raw: Any, path: str, where: str) -> str | None:
    if raw is None:
        return None
    try:
        return schema.dtype_name(schema.dtype_from_name(raw))
    except (ValueError, TypeError) as e:
        raise BadInputError(f"snapshot {where} {raw!r} is not a dtype"[:300], path=path,
                            fix="re-record the run") from e


def precision_mode(path: str, snap: Mapping, amp: str | None, state: Mapping[str, torch.Tensor],
                   params: set[str] | None = None) -> PrecisionMode:
    """Decide the mode from the snapshot: an FSDP policy, else autocast, else the parameters' dtype.

    Args:
        path: the snapshot, named in errors.
        snap: the loaded snapshot (its ``fsdp`` key, when present, holds the policy).
        amp: the snapshot's autocast dtype name (None: no autocast).
        state: the model state replay loads (for an FSDP snapshot, the consolidated one).
        params: the model's parameter names: only a low-precision *parameter* makes the
            ``parameters`` mode (an FP32 model may keep a float16 buffer); None: every entry counts.
    """
    fsdp = snap.get("fsdp")
    policy = fsdp.get("mp_policy") if isinstance(fsdp, Mapping) else None
    if isinstance(policy, Mapping):
        param = _name_of(policy.get("param_dtype"), path, "fsdp.mp_policy.param_dtype")
        if param in _LOW:
            out = _name_of(policy.get("output_dtype"), path, "fsdp.mp_policy.output_dtype")
            if out not in (None, "float16", "bfloat16", "float32", "float64"):
                raise BadInputError(f"snapshot fsdp.mp_policy.output_dtype {out!r} is not a floating dtype",
                                    path=path, fix="re-record the run")
            return PrecisionMode("fsdp_param_dtype", param, output_dtype=out)
    if amp is not None:
        return PrecisionMode("autocast", amp)
    sizes: dict[str, int] = {}
    low: set[str] = set()
    for name, t in state.items():
        dname = schema.dtype_name(t.dtype)
        if dname in _LOW:
            low.add(name)  # buffers too: model.half() made them low precision with the parameters
            if params is None or name in params:
                sizes[dname] = sizes.get(dname, 0) + t.numel()
    if not sizes:
        return PrecisionMode("autocast", None)
    # NB: a model mixing float16 and bfloat16 parameters is replayed in the dtype holding more elements
    dtype = max(sorted(sizes), key=lambda d: sizes[d])
    return PrecisionMode("parameters", dtype, low_names=frozenset(low))


def _targets(model: torch.nn.Module, mode: PrecisionMode, precision: str | None,
             state: Mapping[str, torch.Tensor]) -> dict[str, torch.dtype]:
    """Per parameter/buffer name, the dtype it has in this run (absent: leave it as it is)."""
    out: dict[str, torch.dtype] = {}
    params = dict(model.named_parameters())
    for name, t in list(params.items()) + list(model.named_buffers()):
        rec = state.get(name)
        if rec is None or not rec.is_floating_point():
            continue
        if mode.kind == "parameters":
            low = precision is not None and name in mode.low_names
            out[name] = getattr(torch, precision) if low else rec.dtype
        elif mode.kind == "fsdp_param_dtype" and name in params and precision is not None:
            out[name] = getattr(torch, precision)
        else:
            out[name] = rec.dtype
    return out


def cast_model(model: torch.nn.Module, mode: PrecisionMode, precision: str | None,
               state: Mapping[str, torch.Tensor]) -> None:
    """Give each parameter and floating buffer its dtype for this run, in place, before loading.

    Called before ``load_state_dict``, which then copies the recorded values into tensors of the
    run's dtype (a rounding cast, exactly as ``.to(dtype)``): nothing from an earlier run's dtype
    survives. `precision` None (the input scan) gives every tensor its recorded dtype.
    """
    if mode.kind == "autocast":
        return
    targets = _targets(model, mode, precision, state)
    for p in model.parameters():
        p.grad = None
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for key, p in module._parameters.items():
            want = targets.get(dot + key)
            if p is not None and want is not None and p.dtype != want:
                p.data = p.data.to(want)
                inner = getattr(p, "_data", None)  # torchao's MXFP8 training weight computes with its own _data
                if type(p) is not torch.nn.Parameter and type(inner) is torch.Tensor and inner.shape == p.shape:
                    p._data = inner.to(want)
        for key, b in module._buffers.items():
            want = targets.get(dot + key)
            if b is not None and want is not None and b.dtype != want:
                module._buffers[key] = b.to(want)


def cast_batch(batch: Any, mode: PrecisionMode, precision: str) -> Any:
    """The batch as this run's forward gets it.

    In ``parameters`` mode, floating leaves recorded in low precision follow the run's precision
    (the FP32 run gets an upcast copy); FP32 leaves stay FP32. Other modes return it unchanged
    (FSDP's input cast happens at the model's forward: ``io_hooks``).
    """
    if mode.kind != "parameters":
        return batch
    want = getattr(torch, precision)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(want) if t.is_floating_point() and schema.dtype_name(t.dtype) in _LOW else t

    return map_tensors(batch, cast)


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    return map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() else t)


def io_hooks(model: torch.nn.Module, mode: PrecisionMode, precision: str) -> list:
    """FSDP's casts at the model's forward boundary, as hooks on the root module (removed by the caller).

    ``cast_forward_inputs``: floating positional and keyword inputs to ``param_dtype``;
    ``output_dtype``: floating outputs to it. Only in low-precision runs of ``fsdp_param_dtype``.
    """
    if mode.kind != "fsdp_param_dtype" or precision not in _LOW:
        return []
    dtype = getattr(torch, precision)

    def pre(_module, args, kwargs):
        return _cast_floats(args, dtype), _cast_floats(kwargs, dtype)

    handles = [model.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)]
    if mode.output_dtype is not None:
        out_dtype = getattr(torch, mode.output_dtype)
        handles.append(model.register_forward_hook(lambda _m, _a, out: _cast_floats(out, out_dtype)))
    return handles

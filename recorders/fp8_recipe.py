"""The FP8 / MX training recipe a model holds, as plain JSON data for meta.json and snapshots.

torchao converts a model for FP8 training in place: ``convert_to_float8_training`` swaps
``nn.Linear`` modules for ``Float8Linear`` (each with its ``Float8LinearConfig``), and
``quantize_(model, MXFP8TrainingOpConfig(...))`` wraps Linear weights in an
``MXFP8TrainingWeightWrapperTensor`` that carries its config. A factory usually returns the plain
model and the training script converts it, so replay needs the recipe written down to apply it
again. The recorder imports only torch: both are recognised by their class names and their
``config`` attribute, and the config is written field by field as plain values.

``describe_fp8(model)``::

    {"library": "torchao", "version": "0.18.0",
     "configs": [{"kind": "float8", "class": "torchao.float8.config.Float8LinearConfig",
                  "fields": {"cast_config_input": {"scaling_type": "dynamic",
                                                   "scaling_granularity": "tensorwise",
                                                   "target_dtype": "float8_e4m3fn"}, ..., "emulate": false},
                  "roles": {"input": {"format": "e4m3", "granularity": "tensorwise"},
                            "weight": {...}, "grad_output": {"format": "e5m2", ...}},
                  "emulate": false}],
     "modules": {"blocks.0.mlp.w1": 0, ...}}

``roles`` is the summary readers use: the format and granularity of the cast of each operand
role for its forward use (input, weight) and its first backward use (grad_output), in the names
of ``recorders.fp8`` (``"rowwise"`` for torchao's axiswise scaling, ``"mxfp8"`` for MX blocks with RCEIL scales,
``"mxfp8_floor"`` with FLOOR ones). An MXFP8 entry's roles also name the elements per scale block
(``block_size``: 32, the only size torchao 0.18's MXFP8 training uses; an entry without it means 32) and the
e8m0 scale's rounding (``scale_rounding``: ``"rceil"`` or ``"floor"``, the config's ``scale_calculation_mode``).
Each role also lists its ``uses`` (since format 9): the GEMMs that read it (``schema.FP8_USES``: input for the forward
and the weight gradient, weight for the forward and the input gradient, grad_output for the input and the weight
gradient), each with the format, granularity and scaling of that GEMM's cast (torchao's ``cast_config_*_for_grad_*``
fields; an MXFP8 recipe with ``wgrad_with_hp`` computes the weight gradient in high precision: no such use).
``fields`` keeps everything, so that replay can rebuild the exact config.

Example:
    >>> import torch
    >>> describe_fp8(torch.nn.Linear(4, 4)) is None   # no FP8 module: no entry
    True
"""
from __future__ import annotations

import dataclasses
import enum
import sys
from typing import Any

import torch

from . import schema
from .compiled import clean_name, unwrap
from .fp8 import MX_BLOCK

__all__ = ["FP8_KINDS", "describe_fp8", "fp8_modules"]

FP8_KINDS = ("float8", "mxfp8")  # torchao's Float8Linear; an MXFP8 training weight wrapper
_ROLE_FIELDS = {"input": "cast_config_input", "weight": "cast_config_weight",
                "grad_output": "cast_config_grad_output"}
# torchao 0.18 float8_linear.py: the config field of each (role, use), the first use's being _ROLE_FIELDS'
_SECOND_USE = {"input": ("weight gradient", "cast_config_input_for_grad_weight"),
               "weight": ("input gradient", "cast_config_weight_for_grad_input"),
               "grad_output": ("weight gradient", "cast_config_grad_output_for_grad_weight")}
_GRANULARITY = {"tensorwise": "tensorwise", "axiswise": "rowwise"}
_FORMAT = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_DEFAULT_FORMAT = {"input": "e4m3", "weight": "e4m3", "grad_output": "e5m2"}  # torchao's e4m3/e5m2 defaults


def _plain(v: Any, depth: int = 0) -> Any:
    """A config value as JSON: enums by value, dtypes by name, dataclasses as dicts, others as repr."""
    if depth > 4:
        return repr(v)
    if isinstance(v, enum.Enum):  # before str and int: torchao's enums subclass str
        return _plain(v.value, depth + 1)
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if v == v and abs(v) != float("inf") else repr(v)
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name), depth + 1) for f in dataclasses.fields(v)}
    if isinstance(v, (list, tuple)):
        return [_plain(x, depth + 1) for x in v]
    return repr(v)


def _config_of(mod: torch.nn.Module) -> tuple[str, Any] | None:
    """(kind, config) of an FP8 training module, or None."""
    if type(mod).__name__ == "Float8Linear" and dataclasses.is_dataclass(getattr(mod, "config", None)):
        return "float8", mod.config
    w = getattr(mod, "weight", None)
    if type(w).__name__.startswith("MXFP8Training") and getattr(w, "config", None) is not None:
        return "mxfp8", w.config
    return None


def _cast(role: str, cast: Any) -> dict:
    """One float8 cast config as the format, granularity and scaling of a role's cast."""
    gran = _plain(getattr(cast, "scaling_granularity", None))
    return {"format": _FORMAT.get(getattr(cast, "target_dtype", None), _DEFAULT_FORMAT[role]),
            "granularity": _GRANULARITY.get(gran, gran),
            "scaling": _plain(getattr(cast, "scaling_type", None))}  # "disabled": this operand stays in high precision


def _roles(kind: str, config: Any) -> dict:
    if kind == "mxfp8":  # every operand in e4m3 with e8m0 block scales (the MXFP8 training recipes)
        mode = _plain(getattr(config, "scale_calculation_mode", "rceil"))
        gran = "mxfp8_floor" if str(mode).lower() == "floor" else "mxfp8"
        hp_wgrad = bool(getattr(config, "wgrad_with_hp", False))  # mx_mm: the weight gradient in high precision
        roles = {}
        for r in _ROLE_FIELDS:
            cast = {"format": "e4m3", "granularity": gran}
            uses = [schema.FP8_FIRST_USE[r]] + ([] if hp_wgrad and r != "weight" else [_SECOND_USE[r][0]])
            roles[r] = {**cast, "block_size": MX_BLOCK, "scale_rounding": str(mode).lower(),
                        "uses": {u: dict(cast) for u in uses}}
        return roles
    roles = {}
    for role, field in _ROLE_FIELDS.items():
        first = _cast(role, getattr(config, field, None))
        use, second_field = _SECOND_USE[role]
        second = getattr(config, second_field, None)
        roles[role] = {**first, "uses": {schema.FP8_FIRST_USE[role]: first,
                                         use: first if second is None else _cast(role, second)}}
    return roles


def fp8_modules(model: torch.nn.Module) -> dict[str, tuple[str, Any]]:
    """``{name: (kind, config)}`` of the FP8 training modules of `model` (names without ``_orig_mod.``)."""
    return {clean_name(n): c for n, m in unwrap(model).named_modules() if (c := _config_of(m)) is not None}


def describe_fp8(model: torch.nn.Module) -> dict | None:
    """The recipe entry of `model` (module docstring), or None when it holds no FP8 training module."""
    found = fp8_modules(model)
    if not found:
        return None
    configs: list[dict] = []
    modules: dict[str, int] = {}
    for name, (kind, config) in found.items():
        entry = {"kind": kind, "class": f"{type(config).__module__}.{type(config).__qualname__}",
                 "fields": _plain(config), "roles": _roles(kind, config),
                 "emulate": bool(getattr(config, "emulate", False))
                 or str(_plain(getattr(config, "kernel_preference", ""))).lower() == "emulated"}
        if entry not in configs:
            configs.append(entry)
        modules[name] = configs.index(entry)
    ao = sys.modules.get("torchao")  # NB: never imported here: a converted model has imported it already
    return {"library": "torchao", "version": getattr(ao, "__version__", None), "configs": configs,
            "modules": modules}

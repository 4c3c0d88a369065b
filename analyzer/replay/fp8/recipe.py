"""The FP8 recipe a replay applies: read from the snapshot (or the factory's own model), rebuilt with torchao.

The recorder writes ``describe_fp8(model)`` (``recorders/fp8_recipe.py``) as the snapshot's ``fp8_recipe``
entry: the torchao configs field by field and the modules each one converted. A factory usually returns
the plain model and the training script converts it; replay converts the rebuilt model the same way
(``convert``: ``convert_to_float8_training`` with a ``module_filter_fn`` that takes exactly the recorded
modules). A factory that returns a converted model carries its recipe itself (``recipe_of``); its FP32 and
BF16 runs then use the plain twin (``to_plain``: each ``Float8Linear`` back to an ``nn.Linear`` holding the
same parameters). No entry and no converted module: no FP8 run.

torchao is a trusted dependency: the config is rebuilt from the classes this module names
(``Float8LinearConfig`` and its ``CastConfig``), never from a class name read from the file.

Example:
    >>> recipe = recipe_of(snapshot, model)                     # doctest: +SKIP
    >>> convert(plain_model, recipe, keep_high={"block.mlp.w2"})  # doctest: +SKIP
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import copy

import torch

from recorders.fp8_recipe import describe_fp8, fp8_modules

from ...errors import BadInputError, FactoryError
from ...load.refs import missing_extra

__all__ = ["ENTRY", "recipe_of", "convert", "to_plain", "float8_config", "mx_config", "is_mxfp8", "with_gradients_in", "filter_source"]

ENTRY = "fp8_recipe"  # the snapshot key (and meta.json key) the recorder writes describe_fp8's output under
_CASTS = ("cast_config_input", "cast_config_input_for_grad_weight", "cast_config_weight",
          "cast_config_weight_for_grad_input", "cast_config_grad_output", "cast_config_grad_output_for_grad_weight")
_GEMMS = ("gemm_config_output", "gemm_config_grad_input", "gemm_config_grad_weight")
_FLAGS = ("enable_fsdp_float8_all_gather", "pad_inner_dim", "emulate", "force_recompute_fp8_weight_in_bwd",
          "round_scales_to_power_of_2")
_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
_OUT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def recipe_of(snapshot: Mapping, model: torch.nn.Module | None = None, *, path: str | None = None) -> dict | None:
    """The recipe to replay: the snapshot's ``fp8_recipe`` entry, else that of `model` (a factory that
    returns a converted model), else None (no FP8 run).

    Raises:
        BadInputError: an entry no recorder writes (named, with the key).
    """
    entry = snapshot.get(ENTRY) if hasattr(snapshot, "get") else None
    if entry is None:
        return describe_fp8(model) if model is not None else None
    configs, modules = (entry.get("configs"), entry.get("modules")) if isinstance(entry, dict) else (None, None)
    ok = (isinstance(configs, list) and isinstance(modules, dict) and configs
          and all(isinstance(c, dict) and isinstance(c.get("fields"), dict) and c.get("kind") in ("float8", "mxfp8")
                  for c in configs)
          and all(isinstance(k, str) and isinstance(v, int) and 0 <= v < len(configs) for k, v in modules.items()))
    if not ok:
        raise BadInputError(f"the snapshot's {ENTRY!r} entry is not a recipe the recorder writes "
                            "(configs: a list of torchao configs; modules: name -> config index)",
                            path=path, fix="replay a snapshot written by the recorder, or remove the entry")
    return entry


def _torchao(path: str | None):
    try:
        import torchao.float8 as f8  # noqa: PLC0415 - the [fp8] extra, imported only for an FP8 replay
    except ImportError as e:
        raise FactoryError("the snapshot's step trained in FP8 (torchao); replaying it needs torchao",
                           path=path, fix=missing_extra(ModuleNotFoundError(name="torchao"))) from e
    return f8


def float8_config(fields: Mapping[str, Any], *, path: str | None = None):
    """A ``torchao.float8.Float8LinearConfig`` from the fields ``describe_fp8`` wrote (unknown fields dropped)."""
    f8 = _torchao(path)
    from torchao.float8.config import CastConfig, Float8GemmConfig, ScalingGranularity, ScalingType  # noqa: PLC0415

    kw: dict[str, Any] = {}
    try:
        for name in _CASTS:
            c = fields.get(name)
            if isinstance(c, dict):
                kw[name] = CastConfig(ScalingType(c.get("scaling_type", "dynamic")),
                                      ScalingGranularity(c.get("scaling_granularity", "tensorwise")),
                                      _DTYPES.get(c.get("target_dtype")))
        for name in _GEMMS:
            g = fields.get(name)
            if isinstance(g, dict):
                kw[name] = Float8GemmConfig(use_fast_accum=bool(g.get("use_fast_accum", False)))
        kw.update({k: bool(fields[k]) for k in _FLAGS if k in fields})
        return f8.Float8LinearConfig(**kw)
    except (ValueError, TypeError, AssertionError) as e:
        raise BadInputError(f"the snapshot's FP8 recipe does not make a torchao Float8LinearConfig: {e}",
                            path=path, fix="replay it with the torchao version that wrote it (the entry's 'version')") from e


def convert(model: torch.nn.Module, recipe: Mapping, *, keep_high: Iterable[str] = (), config=None,
            path: str | None = None, device: str = "cpu") -> torch.nn.Module:
    """Convert the recipe's modules of `model` in place, as training did, and return it.

    A ``float8`` entry goes through ``convert_to_float8_training``, an ``mxfp8`` entry through ``quantize_`` with
    an ``MXFP8TrainingOpConfig`` (``mx_config``), each with a filter that takes exactly the entry's modules.

    Args:
        keep_high: modules left in high precision (a fix: their ``module_filter_fn`` excludes them).
        config: one torchao config for every recorded module instead of the recorded ones (a fix): a
            ``Float8LinearConfig`` or an ``MXFP8TrainingOpConfig``.
        device: the device type the step runs on (an MXFP8 recipe runs emulated off CUDA).
    """
    f8 = _torchao(path)
    keep = set(keep_high)
    groups: dict[int, set[str]] = {}
    for name, i in recipe["modules"].items():
        if name not in keep:
            groups.setdefault(i, set()).add(name)
    for i, names in groups.items():
        entry = recipe["configs"][i]
        if config is not None:
            cfg = config
        elif entry["kind"] == "mxfp8":
            cfg = mx_config(entry["fields"], device=device, path=path)
        else:
            cfg = float8_config(entry["fields"], path=path)
        if type(cfg).__name__ == "MXFP8TrainingOpConfig":
            from torchao.quantization import quantize_  # noqa: PLC0415 - [fp8]

            quantize_(model, cfg, filter_fn=lambda m, fqn, names=names: fqn in names and isinstance(m, torch.nn.Linear))
        else:
            f8.convert_to_float8_training(model, config=cfg, module_filter_fn=lambda _m, fqn, names=names: fqn in names)
    return model


def _mx_kernels() -> bool:
    """Whether this CUDA device has torchao's MXFP8 kernels (compute capability 10.0 and up: Blackwell)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 10


def mx_config(fields: Mapping[str, Any], *, device: str = "cpu", path: str | None = None):
    """A ``torchao.prototype.moe_training.config.MXFP8TrainingOpConfig`` from the fields ``describe_fp8`` wrote.

    Off CUDA, and on a CUDA device older than Blackwell (torchao's MXFP8 kernels need compute capability 10.0),
    its kernels are torchao's emulated ones (``KernelPreference.EMULATED``, the only MXFP8 training path torchao
    0.18 runs on a CPU): the casts, their e8m0 scales and the flushing are the same, the GEMM is a
    high-precision mm of the dequantised blocks.
    """
    _torchao(path)
    try:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig  # noqa: PLC0415 - [fp8]
        from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: PLC0415
        from torchao.quantization.quantize_.common import KernelPreference  # noqa: PLC0415
    except ImportError as e:
        raise FactoryError(f"the snapshot's step trained in MXFP8; this torchao has no MXFP8 training ({e})",
                           path=path, fix="install the [fp8] extra's torchao (pip install 'amp-autopsy[fp8]')") from e
    try:
        pref = KernelPreference(fields.get("kernel_preference", "emulated"))
        if device != "cuda" or not _mx_kernels():
            pref = KernelPreference.EMULATED
        return MXFP8TrainingOpConfig(
            kernel_preference=pref, out_dtype=_OUT_DTYPES.get(fields.get("out_dtype"), torch.bfloat16),
            wgrad_with_hp=bool(fields.get("wgrad_with_hp", False)),
            scale_calculation_mode=ScaleCalculationMode(fields.get("scale_calculation_mode", "rceil")),
            pad_token_groups_for_grouped_mm=bool(fields.get("pad_token_groups_for_grouped_mm", False)))
    except (ValueError, TypeError, AssertionError) as e:
        raise BadInputError(f"the snapshot's MXFP8 recipe does not make a torchao MXFP8TrainingOpConfig: {e}",
                            path=path, fix="replay it with the torchao version that wrote it (the entry's 'version')") from e


def is_mxfp8(recipe: Mapping) -> bool:
    """Whether every module of the recipe already trains in MXFP8 with RCEIL scales (the MXFP8 fix's own recipe)."""
    return all(c.get("kind") == "mxfp8" and str(c.get("fields", {}).get("scale_calculation_mode", "rceil")) == "rceil"
               for c in recipe["configs"])


def with_gradients_in(recipe: Mapping, dtype: str) -> dict:
    """A copy of `recipe` whose torchao configs cast the gradients (both GEMMs' ``grad_output``) to `dtype`."""
    out = copy.deepcopy(dict(recipe))
    for entry in out["configs"]:
        for key in ("cast_config_grad_output", "cast_config_grad_output_for_grad_weight"):
            if isinstance(entry["fields"].get(key), dict):
                entry["fields"][key]["target_dtype"] = dtype
    return out


def to_plain(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with each FP8 training Linear swapped back to an ``nn.Linear`` holding the same parameters (an
    MXFP8 training weight back to a plain parameter holding the same values)."""
    for name, (kind, _config) in fp8_modules(model).items():
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        old = getattr(owner, leaf)
        if kind == "mxfp8":
            old.weight = torch.nn.Parameter(old.weight._data.detach(), requires_grad=old.weight.requires_grad)
            continue
        new = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
        new.weight, new.bias = old.weight, old.bias
        setattr(owner, leaf, new)
    return model


def filter_source(keep_high: Iterable[str]) -> str:
    """The ``module_filter_fn`` (Python source, one line) that keeps `keep_high` out of FP8."""
    names = "{" + ", ".join(repr(k) for k in keep_high) + "}"
    return f"module_filter_fn=lambda mod, fqn: fqn not in {names}"

"""recorders.fp8_recipe: the FP8/MX recipe of a model converted by torchao, as plain JSON, rebuilt exactly."""
from __future__ import annotations

import json

import torch

from recorders.fp8_recipe import describe_fp8, fp8_modules
from tests.extras import require


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32),
                               torch.nn.Linear(32, 8))


def test_a_model_without_fp8_modules_has_no_recipe():
    assert describe_fp8(_mlp()) is None


def test_a_tensorwise_model_names_its_converted_modules_and_the_e5m2_gradients():
    float8 = require("torchao.float8", "fp8")
    m = _mlp()
    float8.convert_to_float8_training(m, config=float8.Float8LinearConfig.from_recipe_name("tensorwise"),
                                      module_filter_fn=lambda mod, fqn: fqn != "3")  # the head stays high precision
    d = describe_fp8(m)
    json.dumps(d, allow_nan=False)  # meta.json and snapshots hold it as JSON
    assert d["modules"] == {"0": 0, "2": 0}
    (cfg,) = d["configs"]
    assert cfg["kind"] == "float8" and cfg["emulate"] is False
    assert {r: (v["format"], v["granularity"]) for r, v in cfg["roles"].items()} == {
        "input": ("e4m3", "tensorwise"), "weight": ("e4m3", "tensorwise"), "grad_output": ("e5m2", "tensorwise")}


def test_rowwise_scaling_is_named_rowwise_and_every_role_is_e4m3():
    float8 = require("torchao.float8", "fp8")
    m = _mlp()
    float8.convert_to_float8_training(m, config=float8.Float8LinearConfig.from_recipe_name("rowwise"))
    (cfg,) = describe_fp8(m)["configs"]
    assert {v["granularity"] for v in cfg["roles"].values()} == {"rowwise"}
    assert {v["format"] for v in cfg["roles"].values()} == {"e4m3"}


def test_the_fields_rebuild_the_same_float8_config():
    float8 = require("torchao.float8", "fp8")
    from torchao.float8.config import CastConfig, Float8GemmConfig, ScalingGranularity, ScalingType

    m = _mlp()
    config = float8.Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")
    float8.convert_to_float8_training(m, config=config)
    fields = describe_fp8(m)["configs"][0]["fields"]

    def cast(d):
        return CastConfig(ScalingType(d["scaling_type"]), ScalingGranularity(d["scaling_granularity"]),
                          getattr(torch, d["target_dtype"]) if d["target_dtype"] else None)

    rebuilt = float8.Float8LinearConfig(**{
        k: cast(v) if k.startswith("cast_config") else Float8GemmConfig(**v) if k.startswith("gemm_config") else v
        for k, v in fields.items()})
    assert rebuilt == m[0].config


def test_compiled_models_are_described_by_their_original_names():
    float8 = require("torchao.float8", "fp8")
    m = _mlp()
    float8.convert_to_float8_training(m)
    assert set(fp8_modules(torch.compile(m, backend="eager"))) == {"0", "2", "3"}


def test_an_mxfp8_training_model_is_described_by_its_weight_wrappers():
    require("torchao", "fp8")
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization import quantize_

    m = _mlp()
    quantize_(m, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL),
              filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear) and fqn == "0")
    d = describe_fp8(m)
    assert d["modules"] == {"0": 0}
    (cfg,) = d["configs"]
    assert cfg["kind"] == "mxfp8" and cfg["emulate"] is True
    assert {v["granularity"] for v in cfg["roles"].values()} == {"mxfp8"}
    # the MX recipe's block size and scale rounding, per role (torchao 0.18's MXFP8 training: 32, its config's mode)
    assert {(v["block_size"], v["scale_rounding"]) for v in cfg["roles"].values()} == {(32, "rceil")}


def test_an_mxfp8_floor_recipe_names_its_scale_rounding_and_granularity():
    require("torchao", "fp8")
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization import quantize_

    m = _mlp()
    quantize_(m, MXFP8TrainingOpConfig(scale_calculation_mode=ScaleCalculationMode.FLOOR),
              filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear))
    (cfg,) = describe_fp8(m)["configs"]
    assert {(v["granularity"], v["scale_rounding"]) for v in cfg["roles"].values()} == {("mxfp8_floor", "floor")}


def _uses(cfg: dict) -> dict:
    return {(role, use): (c["format"], c["granularity"], c.get("scaling")) for role, v in cfg["roles"].items()
            for use, c in v["uses"].items()}


def test_each_role_names_the_cast_of_every_gemm_that_reads_it_from_torchaos_per_gemm_configs():
    float8 = require("torchao.float8", "fp8")
    m = _mlp()
    float8.convert_to_float8_training(m, config=float8.Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp"))
    (cfg,) = describe_fp8(m)["configs"]
    # torchao 0.18's rowwise_with_gw_hp: the weight gradient in high precision (its input and grad_output casts
    # disabled), the input gradient's weight cast tensorwise, every other cast rowwise
    assert _uses(cfg) == {
        ("input", "forward"): ("e4m3", "rowwise", "dynamic"),
        ("input", "weight gradient"): ("e4m3", "tensorwise", "disabled"),
        ("weight", "forward"): ("e4m3", "rowwise", "dynamic"),
        ("weight", "input gradient"): ("e4m3", "tensorwise", "dynamic"),
        ("grad_output", "input gradient"): ("e4m3", "rowwise", "dynamic"),
        ("grad_output", "weight gradient"): ("e4m3", "tensorwise", "disabled")}


def test_an_mxfp8_recipe_with_a_high_precision_weight_gradient_has_no_weight_gradient_casts():
    require("torchao", "fp8")
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization import quantize_

    uses = {}
    for recipe in (MXFP8TrainingRecipe.MXFP8_RCEIL, MXFP8TrainingRecipe.MXFP8_RCEIL_WGRAD_WITH_HP):
        m = _mlp()
        quantize_(m, MXFP8TrainingOpConfig.from_recipe(recipe),
                  filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear))
        (cfg,) = describe_fp8(m)["configs"]
        uses[recipe] = set(_uses(cfg))
    assert uses[MXFP8TrainingRecipe.MXFP8_RCEIL] == {
        ("input", "forward"), ("input", "weight gradient"), ("weight", "forward"), ("weight", "input gradient"),
        ("grad_output", "input gradient"), ("grad_output", "weight gradient")}
    assert uses[MXFP8TrainingRecipe.MXFP8_RCEIL_WGRAD_WITH_HP] == {
        ("input", "forward"), ("weight", "forward"), ("weight", "input gradient"), ("grad_output", "input gradient")}

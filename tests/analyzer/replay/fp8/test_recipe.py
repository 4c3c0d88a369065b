"""The FP8 recipe a replay applies: the snapshot's ``fp8_recipe`` entry read back into torchao configs."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.errors import BadInputError
from analyzer.replay.fp8.recipe import convert, float8_config, mx_config, recipe_of, to_plain, with_gradients_in
from recorders.fp8_recipe import describe_fp8, fp8_modules
from tests.extras import require

from . import swiglu_models as sm

f8 = require("torchao.float8", "fp8")

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=30), c, max_size=5),
                     max_leaves=30)
_cast = st.fixed_dictionaries({"scaling_type": st.sampled_from(["dynamic", "disabled", "static", 3]),
                               "scaling_granularity": st.sampled_from(["tensorwise", "axiswise", "rowwise", None]),
                               "target_dtype": st.sampled_from(["float8_e4m3fn", "float8_e5m2", "int8", None])})
_fields = st.dictionaries(st.sampled_from(["cast_config_input", "cast_config_weight", "cast_config_grad_output",
                                           "emulate", "round_scales_to_power_of_2", "gemm_config_output", "other"]),
                          _cast | _json, max_size=7)


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_the_recorded_fields_rebuild_the_config_that_trained(name):
    cfg = f8.Float8LinearConfig.from_recipe_name(name)
    model = f8.convert_to_float8_training(sm.build(), config=cfg)
    entry = describe_fp8(model)
    assert float8_config(entry["configs"][0]["fields"]) == cfg
    assert recipe_of({"fp8_recipe": entry}) is entry


def test_convert_takes_exactly_the_recorded_modules_and_keep_high_leaves_one_out():
    model = f8.convert_to_float8_training(sm.build(), config=f8.Float8LinearConfig.from_recipe_name("tensorwise"),
                                          module_filter_fn=lambda _m, fqn: fqn.startswith("block.mlp"))
    entry = describe_fp8(model)
    again = convert(sm.build(), entry, keep_high={"block.mlp.w2"})
    assert set(fp8_modules(again)) == {"block.mlp.w1", "block.mlp.w3"}


def test_to_plain_gives_back_linears_with_the_same_parameters_and_outputs():
    converted = f8.convert_to_float8_training(sm.build(), config=f8.Float8LinearConfig.from_recipe_name("tensorwise"))
    weight = converted.block.mlp.w2.weight
    plain = to_plain(converted)
    assert fp8_modules(plain) == {} and plain.block.mlp.w2.weight is weight
    idx = sm.batch()["idx"]
    torch.testing.assert_close(plain(idx), sm.build()(idx), rtol=0, atol=0)


def test_no_entry_and_a_plain_model_mean_no_fp8_run():
    assert recipe_of({}, sm.build()) is None and recipe_of({}) is None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entry=_json | st.fixed_dictionaries({"configs": st.lists(st.fixed_dictionaries(
    {"kind": st.sampled_from(["float8", "mxfp8", "te"]), "fields": _fields}), max_size=2),
    "modules": st.dictionaries(st.text(max_size=10), st.integers(-1, 2) | st.text(max_size=3), max_size=3)}))
def test_any_entry_is_a_recipe_or_one_bad_input_error_naming_the_key(entry):
    try:
        got = recipe_of({"fp8_recipe": entry}, path="s.pt")
    except BadInputError as e:
        assert "'fp8_recipe'" in str(e) and "s.pt" in str(e)
        return
    assert got is entry  # None is no entry at all: the model decides
    if got is not None:  # what convert reads: every module names one of the configs
        assert all(isinstance(i, int) and 0 <= i < len(got["configs"]) for i in got["modules"].values())
    for c in (got or {}).get("configs", []):
        try:
            if c["kind"] == "mxfp8":  # rebuilt as torchao's MXFP8 training config, emulated on CPU
                assert type(mx_config(c["fields"], path="s.pt")).__name__ == "MXFP8TrainingOpConfig"
            else:
                assert isinstance(float8_config(c["fields"], path="s.pt"), f8.Float8LinearConfig)
        except BadInputError as e:
            assert "s.pt" in str(e)


def test_a_recorded_mxfp8_recipe_rebuilds_its_config_and_runs_emulated_off_cuda():
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    fields = {"kernel_preference": "auto", "out_dtype": "bfloat16", "wgrad_with_hp": True,
              "scale_calculation_mode": "floor", "pad_token_groups_for_grouped_mm": False}
    cfg = mx_config(fields)
    assert isinstance(cfg, MXFP8TrainingOpConfig) and cfg.wgrad_with_hp is True
    assert cfg.scale_calculation_mode == ScaleCalculationMode.FLOOR
    assert cfg.kernel_preference == KernelPreference.EMULATED  # recorded AUTO: CUDA kernels, none on a CPU
    blackwell = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 10
    assert mx_config(fields, device="cuda").kernel_preference == (
        KernelPreference.AUTO if blackwell else KernelPreference.EMULATED)
    with pytest.raises(BadInputError, match="MXFP8TrainingOpConfig"):
        mx_config({**fields, "scale_calculation_mode": "sideways"}, path="s.pt")


def test_with_gradients_in_e5m2_changes_only_the_gradient_casts_of_an_all_e4m3_recipe():
    entry = describe_fp8(f8.convert_to_float8_training(sm.build(), config=f8.Float8LinearConfig.from_recipe_name("rowwise")))
    cfg = float8_config(with_gradients_in(entry, "float8_e5m2")["configs"][0]["fields"])
    assert cfg.cast_config_grad_output.target_dtype == torch.float8_e5m2
    assert cfg.cast_config_grad_output_for_grad_weight.target_dtype == torch.float8_e5m2
    assert cfg.cast_config_input.target_dtype == cfg.cast_config_weight.target_dtype == torch.float8_e4m3fn
    assert entry["configs"][0]["fields"]["cast_config_grad_output"]["target_dtype"] == "float8_e4m3fn"  # a copy

"""Run directories holding values no training run writes: each is named by ``implausible_trace`` or
refused with one ``Error:`` line, never analysed in silence."""
from __future__ import annotations

import json
import math

import polars as pl
import pytest

from recorders import schema

from ...test_hostile_inputs import _implausible, _trace_run, assert_one_error_line, invoke


def _edit_meta(run, **changes):
    meta = json.loads((run / schema.META_FILE).read_text())
    for k, v in changes.items():
        if isinstance(v, dict) and isinstance(meta.get(k), dict):
            meta[k] = {**meta[k], **v}
        else:
            meta[k] = v
    (run / schema.META_FILE).write_text(json.dumps(meta))
    return run


def test_layer_ids_while_meta_json_lists_no_parameters_are_named(tmp_path):
    f = _implausible(_edit_meta(_trace_run(tmp_path), params=[]))
    assert f["evidence"]["params"] == 0 and f["evidence"]["layers_without_params"] == 8
    assert "layer ids 0..7 while meta.json lists no parameters" in f["message"]


@pytest.mark.parametrize("key, value", [("growth_interval", math.nan), ("growth_interval", 0),
                                        ("growth_interval", 2.5), ("growth_interval", "2000"),
                                        ("growth_factor", 0.5), ("backoff_factor", 2.0), ("init_scale", -1.0)])
def test_scaler_settings_gradscaler_refuses_are_named(tmp_path, key, value):
    f = _implausible(_edit_meta(_trace_run(tmp_path), scaler={key: value}))
    assert f["evidence"]["bad_scaler_settings"] == {key: str(value)}
    assert f"meta.json's scaler settings {key} {str(value)!r} are not GradScaler's" in f["message"]


def test_an_integral_float_growth_interval_is_a_real_setting(tmp_path):
    res = invoke(["report", str(_edit_meta(_trace_run(tmp_path), scaler={"growth_interval": 2000.0})), "--json"])
    assert res.exit_code == 0
    assert not [f for f in json.loads(res.stdout)["findings"] if f["check"] == "implausible_trace"]


@pytest.mark.parametrize("scale", [0.0, -4.0, math.inf])
def test_steps_trained_under_a_scale_gradscaler_skips_are_named(tmp_path, scale):
    def rewrite(df):
        return df.with_columns(pl.when(pl.col("step").is_between(10, 34)).then(scale).otherwise(pl.col("scale"))
                               .alias("scale"), pl.when(pl.col("step").is_between(10, 34)).then(False)
                               .otherwise(pl.col("skipped")).alias("skipped"))

    f = _implausible(_trace_run(tmp_path, steps=rewrite))
    assert f["evidence"]["unskipped_bad_scale_steps"] == 25 and f["evidence"]["first_bad_scale_step"] == 10
    assert f"25 step(s) not skipped under a loss scale of {scale:g} (first at step 10)" in f["message"]


def test_a_skipped_step_under_a_zero_scale_is_no_implausible_value(tmp_path):
    def rewrite(df):
        return df.with_columns(pl.when(pl.col("step") == 10).then(0.0).otherwise(pl.col("scale")).alias("scale"),
                               pl.when(pl.col("step") == 10).then(True).otherwise(pl.col("skipped")).alias("skipped"))

    res = invoke(["report", str(_trace_run(tmp_path, steps=rewrite)), "--json"])
    assert res.exit_code == 0
    assert not [f for f in json.loads(res.stdout)["findings"] if f["check"] == "implausible_trace"]


@pytest.mark.parametrize("kind", ["steps", "layers"])
def test_an_empty_part_is_refused_naming_it(tmp_path, kind):
    from ..report.report_models import Script

    script = Script(n=40)
    run = script.write(tmp_path / "run", parts=3)
    part = run / schema.TRACE_DIR / schema.part_name(kind, 0, 1)
    pl.DataFrame(schema=schema.STEP_COLUMNS if kind == "steps" else schema.LAYER_COLUMNS).write_parquet(part)
    res = invoke(["report", str(run)])
    line = assert_one_error_line(res.exit_code, res.stderr, res.stdout)
    assert line == (f"Error: {part}: {kind} part holds no rows: the Recorder never writes an empty part, so the steps "
                    "it held are gone (move the damaged part out of trace/ to analyse the rest of the run, or restore "
                    "it from the training host)")

"""The fp8 trace parts and the snapshot's fp8 entries (format 8) read as written, or give one Error: line."""
from __future__ import annotations

import json

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.errors import BadInputError
from analyzer.load import load_run, load_snapshot
from recorders import schema
from recorders.snapshot import write_snapshot

from ...hostile_corpus import run_dir, snapshot_dict
from ...test_hostile_inputs import assert_one_error_line, invoke

_ROW = {"step": 3, "rank": 0, "module": "mlp.w2", "role": "input", "use": "forward", "call": 0, "format": "e4m3",
        "granularity": "tensorwise", "numel": 4096, "nonzero": 4096, "amax": 2.0e4, "saturated": 0, "flushed": 4000,
        "subnormal": 20, "scale_min": 0.0224, "scale_max": 0.0224}  # what recorders/_fp8_watch.py writes


def _with_fp8(d, rows: list[dict], schema_=schema.FP8_COLUMNS) -> str:
    run = run_dir(d)
    pl.DataFrame(rows, schema=schema_).write_parquet(run / schema.TRACE_DIR / schema.part_name("fp8", 0, 0))
    return str(run)


def test_an_fp8_part_reads_back_as_written_and_the_report_names_its_cast(tmp_path):
    run = _with_fp8(tmp_path, [_ROW, {**_ROW, "step": 5, "flushed": 10}])
    assert load_run(run).fp8.collect().to_dicts()[0] == _ROW
    res = invoke(["report", run, "--json"])
    (f,) = [f for f in json.loads(res.stdout)["findings"] if f["check"] == "fp8_casts"]
    assert (f["step"], f["evidence"]["steps_over"], f["evidence"]["steps_measured"]) == (3, 1, 2)


def test_a_format_8_part_without_the_use_column_reads_each_role_as_its_first_use(tmp_path):
    old = {k: v for k, v in schema.FP8_COLUMNS.items() if k != "use"}
    rows = [{k: v for k, v in {**_ROW, "role": role}.items() if k != "use"} for role in schema.FP8_ROLES]
    run = _with_fp8(tmp_path, rows, old)
    got = load_run(run).fp8.collect()
    assert dict(zip(got["role"], got["use"])) == {"input": "forward", "weight": "forward",
                                                  "grad_output": "input gradient"}  # what format 8 measured
    res = invoke(["report", run, "--json"])
    assert res.exit_code == 0, res.output
    (f,) = [f for f in json.loads(res.stdout)["findings"]
            if f["check"] == "fp8_casts" and f["evidence"]["role"] == "input"]
    assert f["evidence"]["use"] == "forward" and "mlp.w2 input (forward GEMM, e4m3 tensorwise)" in f["message"]


def test_a_format_8_snapshot_reads_its_casts_as_their_roles_first_use(tmp_path):
    cast = {k: _ROW.get(k, 0.9) for k in schema.FP8_CAST_KEYS if k != "use"}
    grad = {**cast, "role": "grad_output", "format": "e5m2"}
    fp8 = {"casts": [cast, grad], "fired": grad, "flush_limit": 0.05, "saturate_limit": 1e-4,
           "transformer_engine": None}
    snap = load_snapshot(write_snapshot(tmp_path / "s.pt", snapshot_dict(format_version=8, fp8=fp8)))
    assert [c["use"] for c in snap.fp8["casts"]] == ["forward", "input gradient"]
    assert snap.fp8["fired"]["use"] == "input gradient"
    assert "use" not in fp8["casts"][0]  # the file's own dicts are left as they were


def test_a_foreign_or_truncated_fp8_part_is_one_error_line_naming_it(tmp_path):
    run = _with_fp8(tmp_path / "a", [{"x": 1.0}], {"x": pl.Float64})
    line = assert_one_error_line(*_run(run))
    assert "fp8-r00000-p000000.parquet" in line and "foreign Parquet part" in line
    run = _with_fp8(tmp_path / "b", [_ROW])
    part = tmp_path / "b" / "run" / schema.TRACE_DIR / schema.part_name("fp8", 0, 0)
    part.write_bytes(part.read_bytes()[:40])
    assert "fp8-r00000-p000000.parquet" in assert_one_error_line(*_run(run))


def _run(run: str) -> tuple[int, str, str]:
    res = invoke(["report", run, "--json"])
    return res.exit_code, res.stderr, res.stdout


_INT = st.one_of(st.none(), st.integers(-2**62, 2**62))
_FLOAT = st.one_of(st.none(), st.floats())
_TEXT = st.one_of(st.none(), st.text(max_size=20))
_ROWS = st.lists(st.fixed_dictionaries({
    "step": _INT, "rank": st.one_of(st.none(), st.integers(-3, 3)), "module": _TEXT, "role": _TEXT, "use": _TEXT,
    "call": st.one_of(st.none(), st.integers(-2, 2)), "format": _TEXT, "granularity": _TEXT, "numel": _INT,
    "nonzero": _INT, "amax": _FLOAT, "saturated": _INT, "flushed": _INT, "subnormal": _INT, "scale_min": _FLOAT,
    "scale_max": _FLOAT}), min_size=1, max_size=6)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=_ROWS)
def test_any_values_in_an_fp8_part_give_a_report_or_one_error_line(tmp_path_factory, rows):
    code, err, out = _run(_with_fp8(tmp_path_factory.mktemp("fp8"), rows))
    if code != 0:
        assert_one_error_line(code, err, out)
    else:
        assert "Traceback" not in err + out and "check_failed" not in out


def test_the_snapshot_fp8_entries_load_as_written(tmp_path):
    cast = {k: _ROW.get(k, 0.9) for k in schema.FP8_CAST_KEYS}
    fp8 = {"casts": [cast], "fired": cast, "flush_limit": 0.05, "saturate_limit": 1e-4, "transformer_engine": None}
    snap = load_snapshot(write_snapshot(tmp_path / "s.pt", snapshot_dict(fp8=fp8, fp8_recipe={"library": "torchao"})))
    assert snap.fp8 == fp8 and snap.fp8_recipe == {"library": "torchao"}


def test_a_format_7_snapshot_without_fp8_keys_loads_with_none(tmp_path):
    raw = snapshot_dict(format_version=7)
    del raw["fp8"], raw["fp8_recipe"]
    snap = load_snapshot(write_snapshot(tmp_path / "s.pt", raw))
    assert snap.fp8 is None and snap.fp8_recipe is None


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
                    st.lists(st.one_of(st.none(), st.dictionaries(st.sampled_from(schema.FP8_CAST_KEYS + ("x",)),
                                                                  st.integers(), max_size=3)), max_size=2))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fp8=st.one_of(_VALUES, st.dictionaries(st.sampled_from(schema.FP8_KEYS + ("x",)), _VALUES, max_size=4)),
       recipe=st.one_of(st.none(), st.integers(), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)))
def test_any_fp8_entry_loads_or_gives_one_bad_input_error(tmp_path_factory, fp8, recipe):
    path = write_snapshot(tmp_path_factory.mktemp("s") / "s.pt", snapshot_dict(fp8=fp8, fp8_recipe=recipe))
    try:
        snap = load_snapshot(path)
    except BadInputError as e:
        assert ("'fp8'" in str(e) or "'fp8_recipe'" in str(e)) and "\n" not in str(e)
        return
    assert repr(snap.fp8) == repr(fp8) and repr(snap.fp8_recipe) == repr(recipe)

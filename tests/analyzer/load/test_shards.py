"""FSDP2 shard statistics: merged into whole-parameter rows, hostile shard layouts refused, and
version-2 runs and snapshots (no ``fsdp`` key) still read.

The end-to-end check against real ``fully_shard`` runs is ``tests/test_distributed.py``; here the
merge rule itself is checked on generated shard rows (hypothesis), with NaN, inf, nulls and
empty shards.
"""
from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.errors import BadInputError
from analyzer.load import load_run, load_snapshot
from analyzer.load.shards import merge_shards, shard_table
from recorders import schema
from recorders.snapshot import build_snapshot, write_snapshot

from ..report.report_models import Script

_value = st.one_of(st.none(), st.just(float("nan")), st.just(float("inf")),
                   st.floats(0, 2.0**100, allow_nan=False, width=32))


@st.composite
def _sharded_rows(draw):
    """(layer table rows, shard table, world size, a (step, layer) whose last rank is missing or None)."""
    world = draw(st.integers(1, 3))
    n_layers, n_steps = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    numels = {(r, l): draw(st.integers(0, 6)) for r in range(world) for l in range(n_layers)}
    rows = []
    for s in range(n_steps):
        for r in range(world):
            for l in range(n_layers):
                rows.append({"step": s, "rank": r, "layer": l, "grad_norm": draw(_value), "param_norm": draw(_value),
                             "grad_nonfinite": draw(st.integers(0, 5)),
                             "grad_zero_frac": draw(st.one_of(st.none(), st.floats(0, 1, width=32)))})
    missing = None
    if world > 1 and draw(st.booleans()):
        missing = (draw(st.integers(0, n_steps - 1)), draw(st.integers(0, n_layers - 1)))
        rows = [x for x in rows if (x["step"], x["layer"], x["rank"]) != (*missing, world - 1)]
    table = pl.DataFrame({"rank": [k[0] for k in numels], "layer": [k[1] for k in numels],
                          "local_numel": list(numels.values())},
                         schema={"rank": pl.Int32, "layer": pl.Int32, "local_numel": pl.Int64})
    return rows, table, world, missing


def _f32(x: float) -> float:
    return float(np.float32(x))


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_sharded_rows())
def test_merged_rows_are_whole_parameters_and_incomplete_groups_are_left_out(case):
    rows, table, world, missing = case
    cols = {c: t for c, t in schema.LAYER_COLUMNS.items() if c in rows[0]}
    lf = pl.DataFrame(rows, schema=cols).lazy()
    merged = merge_shards(lf, table, world).collect()
    numel = {(r, l): n for r, l, n in table.iter_rows()}
    groups: dict[tuple[int, int], list[dict]] = {}
    for x in rows:
        groups.setdefault((x["step"], x["layer"]), []).append(x)
    expected_keys = {k for k, g in groups.items() if len(g) == world}
    assert missing is None or missing not in expected_keys
    got = {(s, l): row for s, l, row in zip(merged["step"], merged["layer"], merged.iter_rows(named=True))}
    assert set(got) == expected_keys
    for key in expected_keys:
        g, row = groups[key], got[key]
        for c in ("grad_norm", "param_norm"):
            vals = [_f32(x[c]) for x in g if x[c] is not None]
            want = None if not vals else _f32(math.sqrt(sum(v * v for v in vals)))  # float64 squares
            assert _same(row[c], want), (c, g, row)
        assert row["grad_nonfinite"] == sum(x["grad_nonfinite"] for x in g)
        zf = [(_f32(x["grad_zero_frac"]), numel[(x["rank"], x["layer"])]) for x in g
              if x["grad_zero_frac"] is not None and numel[(x["rank"], x["layer"])] > 0]
        want_zf = (sum(z * n for z, n in zf) / sum(n for _, n in zf)) if zf else None
        if any(x["grad_zero_frac"] is not None for x in g):
            assert _same(row["grad_zero_frac"], None if want_zf is None else _f32(want_zf)), (g, row)
        bad = [x["rank"] for x in g if x["grad_nonfinite"] > 0
               or any(x[c] is not None and not math.isfinite(x[c]) for c in ("grad_norm", "param_norm"))]
        assert row["rank"] == (min(bad) if bad else None)


def _fsdp_run(tmp_path, local_numels=(4, 4)):
    """A 2-rank run directory whose meta says its one parameter (8 elements) is sharded."""
    run = tmp_path / "run"
    for rank, n in enumerate(local_numels):
        script = Script(n=6, rank=rank)
        script.write(run, parts=1, world_size=2)
        meta_path = run / schema.meta_name(rank)
        meta = json.loads(meta_path.read_text())
        meta["fsdp"] = {"mp_policy": {"param_dtype": "bfloat16", "reduce_dtype": "float32", "output_dtype": None},
                        "mesh": {"device_type": "cpu", "shape": [2], "dim_names": None}, "world_size": 2}
        for p in meta["params"]:
            p.update(sharded=True, local_numel=n, local_shape=[n], local_offset=[rank * 4])
        meta_path.write_text(json.dumps(meta))
    return run


def test_an_fsdp_run_s_shard_table_comes_from_every_rank_s_meta(tmp_path):
    run = load_run(_fsdp_run(tmp_path))
    assert run.shards is not None and run.world_size == 2
    assert sorted(set(run.shards["local_numel"].to_list())) == [4]
    assert any("sharded (FSDP2) run" in n for n in run.notes)


@pytest.mark.parametrize("bad", [-1, True, "4", 10**9, 1.5])
def test_a_shard_size_that_is_not_a_piece_of_the_parameter_is_one_error_naming_the_rank_s_meta(tmp_path, bad):
    run = _fsdp_run(tmp_path, local_numels=(4, bad))
    with pytest.raises(BadInputError, match=r"meta-r00001\.json: rank 1's meta params\[0\] local_numel") as e:
        load_run(run)
    assert "\n" not in str(e.value)


def test_a_run_without_the_fsdp_key_is_never_merged(tmp_path):
    run_dir = Script(n=6).write(tmp_path / "run", parts=1)
    meta = json.loads((run_dir / schema.META_FILE).read_text())
    meta["format_version"] = 2  # a version-2 run: no fsdp key at all
    meta.pop("fsdp", None)
    (run_dir / schema.META_FILE).write_text(json.dumps(meta))
    run = load_run(run_dir)
    assert run.shards is None


def _snapshot(tmp_path, **overrides):
    snap = build_snapshot(step=3, reason="manual", model=torch.nn.Linear(2, 2), batch={"x": torch.ones(1, 2)},
                          rng={"cpu": torch.get_rng_state(), "cuda": None}, factory=None, factory_kwargs={},
                          loss_fn=None, amp_dtype=None, device_type="cpu")
    snap.update(overrides)
    path = tmp_path / "snap.pt"
    write_snapshot(path, snap)
    return path


def test_a_version_2_snapshot_without_the_version_3_keys_loads_with_fsdp_none(tmp_path):
    path = _snapshot(tmp_path, format_version=2)
    raw = torch.load(path, weights_only=True)
    for key, version in schema.KEYS_ADDED.items():
        if version > 2:
            del raw[key]
    torch.save(raw, path)
    snap = load_snapshot(path)
    assert snap.fsdp is None and "fsdp" not in snap and snap.format_version == 2


_ENTRY = {"dcp_dir": "step00000003-manual.dcp", "mp_policy": {"param_dtype": "bfloat16", "reduce_dtype": None,
                                                              "output_dtype": None},
          "mesh": {"device_type": "cpu", "shape": [2], "dim_names": None}, "world_size": 2,
          "local_state": None, "layout": None}


def test_a_snapshot_s_fsdp_entry_loads_as_written(tmp_path):
    assert load_snapshot(_snapshot(tmp_path, fsdp=dict(_ENTRY))).fsdp == _ENTRY


@pytest.mark.parametrize("change, message", [
    ({"dcp_dir": "../../elsewhere.dcp"}, "dcp_dir should be a name like"),
    ({"dcp_dir": "/abs/step00000003-manual.dcp"}, "dcp_dir should be a name like"),
    ({"world_size": 0}, "world_size should be an integer >= 1"),
    ({"local_state": {"w": torch.zeros(1).expand(10**9)}}, "refusing to materialise"),
    ({"local_state": {"w": [1.0]}}, "is not a named tensor"),
    ({"surprise": 1}, "should be None or a dict with keys"),
])
def test_a_hostile_fsdp_entry_is_one_error_naming_the_key(tmp_path, change, message):
    path = _snapshot(tmp_path, fsdp={**_ENTRY, **change})
    with pytest.raises(BadInputError, match=message) as e:
        load_snapshot(path)
    assert "\n" not in str(e.value)

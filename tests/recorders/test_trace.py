"""Trace parts: what is written is what is read, column for column; part numbering."""
from __future__ import annotations

import math

import polars as pl
import torch

from recorders import schema
from recorders.trace import GRAD_NORM, PARAM_NORM, UNCHANGED, UPDATE_RMS, ZERO_FRAC, LayerBuffer, TraceWriter

NAN, INF = float("nan"), float("inf")


def test_a_steps_part_reads_back_equal_column_for_column_with_nan_inf_and_nulls(tmp_path):
    rows = [
        {"step": 0, "rank": 3, "wall_time": 1.7e9, "loss": 2.5, "loss_dtype": "float32", "scale": 65536.0,
         "skipped": False, "grad_norm": 0.125, "lr": 1e-3, "nonfinite_grads": 0},
        {"step": 1, "rank": 3, "wall_time": 1.7e9 + 1, "loss": NAN, "loss_dtype": "float16", "scale": 32768.0,
         "skipped": True, "grad_norm": INF, "lr": 1e-3, "nonfinite_grads": 12},
        {"step": 2, "rank": 3, "wall_time": 1.7e9 + 2, "loss": -INF, "loss_dtype": None, "scale": None,
         "skipped": None, "grad_norm": None, "lr": None, "nonfinite_grads": None},
    ]
    [path] = TraceWriter(tmp_path, rank=3).write(rows, None)
    assert path.name == "steps-r00003-p000000.parquet"
    back = pl.read_parquet(path)
    assert dict(back.schema) == schema.STEP_COLUMNS
    assert back.equals(pl.DataFrame(rows, schema=schema.STEP_COLUMNS))
    assert back.to_dicts()[2] == rows[2]
    # NaN and Inf are kept as they are, never filtered or turned into nulls
    assert math.isnan(back["loss"][1]) and back["grad_norm"][1] == INF and back["loss"][2] == -INF


def test_layer_rows_cross_from_the_device_buffer_to_a_part_unchanged(tmp_path):
    buf = LayerBuffer(rows=4, n_params=3, device=torch.device("cpu"))
    block = buf.next_block()  # step 7: no update statistics
    block[GRAD_NORM] = torch.tensor([0.5, INF, 2.0])
    block[PARAM_NORM] = torch.tensor([1.0, 2.0, 3.0])
    block[ZERO_FRAC] = torch.tensor([0.0, 0.25, 1.0])
    buf.commit(7, None, [0, 5, 0], [False] * 3)
    # step 8: parameter 1 has no gradient (frozen or unused): its gradient columns are null
    # step 8: update columns for parameters 0 and 1 (parameter 2 has none: null), NaN kept as NaN
    block = buf.next_block()
    block[GRAD_NORM] = torch.tensor([0.75, 9.0, NAN])
    block[PARAM_NORM] = torch.tensor([1.5, 2.5, 3.5])
    block[UPDATE_RMS] = torch.tensor([0.25, NAN, 9.0])
    block[UNCHANGED] = torch.tensor([0.5, 1.0, 9.0])
    block[ZERO_FRAC] = torch.tensor([0.5, 9.0, 0.125])
    buf.commit(8, [0, 2], None, [True, True, False])
    frame = buf.drain(rank=1)
    assert len(buf) == 0
    [path] = TraceWriter(tmp_path, rank=1).write([], frame)
    back = pl.read_parquet(path)
    assert dict(back.schema) == schema.LAYER_COLUMNS
    assert back.equals(frame)
    rows = back.rows()
    # step 7 passed no update statistics: update_rms and unchanged_frac are null
    assert rows[:3] == [(7, 1, 0, 0.5, 1.0, 0, 0.0, None, None), (7, 1, 1, INF, 2.0, 5, 0.25, None, None),
                        (7, 1, 2, 2.0, 3.0, 0, 1.0, None, None)]
    assert rows[3] == (8, 1, 0, 0.75, 1.5, 0, 0.5, 0.25, 0.5)
    assert rows[4][:7] == (8, 1, 1, None, 2.5, None, None) and math.isnan(rows[4][7]) and rows[4][8] == 1.0
    assert rows[5][:3] == (8, 1, 2) and math.isnan(rows[5][3]) and rows[5][4:] == (3.5, 0, 0.125, None, None)


def test_part_numbers_continue_after_this_ranks_parts_and_ignore_other_ranks(tmp_path):
    row = {"step": 0, "rank": 0, "wall_time": 0.0, "loss": 1.0, "loss_dtype": None, "scale": None,
           "skipped": False, "grad_norm": 1.0, "lr": None, "nonfinite_grads": 0}
    TraceWriter(tmp_path, rank=0).write([row], None)
    TraceWriter(tmp_path, rank=0).write([row], None)
    for _ in range(3):
        TraceWriter(tmp_path, rank=1).write([dict(row, rank=1)], None)
    # a temporary file left by a killed writer does not count and is ignored by readers
    (tmp_path / "trace" / ".steps-r00000-p000009.parquet.123.tmp").write_bytes(b"partial")
    [path] = TraceWriter(tmp_path, rank=0).write([row], None)
    assert path.name == schema.part_name("steps", 0, 2)
    assert sorted(p.name for p in (tmp_path / "trace").glob(schema.STEPS_GLOB))[-1] == schema.part_name("steps", 1, 2)
    assert pl.read_parquet(tmp_path / "trace" / schema.STEPS_GLOB).height == 6


def test_empty_flushes_write_nothing(tmp_path):
    assert TraceWriter(tmp_path, rank=0).write([], None) == []
    assert not list((tmp_path / "trace").iterdir())

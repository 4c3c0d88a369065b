"""``agree.decide``: the verdict every rank reaches from the gathered run summaries (a pure function).

The summaries are written out as ``agree.summarize`` makes them; the end-to-end runs that produce real
ones are in ``tests/test_distributed_replay.py``.
"""
from __future__ import annotations

import math

import pytest

from analyzer.replay.distributed import decide

INF, NAN = math.inf, math.nan


def op(index, name="aten.mm", inp=1.0, out=1.0, module="0", phase="forward", dtypes=("float16",)):
    return {"op": name, "overload": "default", "module": module, "phase": phase, "index": index, "source": None,
            "precision": "float16", "input_dtypes": list(dtypes), "output_dtype": dtypes[0],
            "input_absmax": inp, "output_absmax": out}


def run(finite=True, first=None, first_input=None, collectives=()):
    return {"precision": "float16", "loss": 1.0, "forward_finite": True, "grads_finite": finite,
            "grad_absmax": 1.0, "finite": finite, "ops": 200, "first": first, "first_input": first_input,
            "collectives": list(collectives)}


RS = "c10d._reduce_scatter_base_"


def test_a_reduce_scatter_with_finite_inputs_on_every_rank_and_an_inf_sum_is_the_overflow():
    fp32 = [run(collectives=[op(112, RS, 4e4, 8e4, dtypes=("float32",))]),
            run(collectives=[op(112, RS, 4e4, 0.0, dtypes=("float32",))])]
    low = [run(False, collectives=[op(112, RS, 4e4, INF)]), run(True, collectives=[op(112, RS, 4e4, 0.0)])]
    d = decide({"float32": fp32, "float16": low}, "float16", [])
    assert d.verdict == "overflow" and d.culprit["op"] == RS and d.culprit["rank"] == 0
    coll = d.culprit["collective"]
    assert [r["input_absmax"] for r in coll["ranks"]] == [4e4, 4e4] and coll["ranks"][0]["output_absmax"] == INF
    assert coll["reduce_dtype"] == "float16" and coll["fp32_output_absmax"] == 8e4


def test_a_reduce_scatter_that_only_carries_one_ranks_inf_is_not_a_sum_that_overflowed():
    # rank 1's gradient was cast to float16 in FSDP2's own hook (never a culprit) and became inf there:
    # the reduction's input is already inf on rank 1, so the reduction did not make the inf
    fp32 = [run(), run()]
    low = [run(False, collectives=[op(112, RS, 1.0, INF)]), run(False, collectives=[op(112, RS, INF, INF)])]
    d = decide({"float32": fp32, "float16": low}, "float16", [])
    assert d.verdict == "not_classified" and d.culprit is None


def test_an_op_before_the_reduction_that_made_the_nan_is_the_culprit_not_the_reduction():
    fp32 = [run(), run()]
    low = [run(False, collectives=[op(112, RS, 1.0, NAN)]),
           run(False, first=op(90, "aten.div", 1.0, NAN, phase="backward"), collectives=[op(112, RS, NAN, NAN)])]
    d = decide({"float32": fp32, "float16": low}, "float16", [])
    assert d.culprit["op"] == "aten.div" and d.culprit["rank"] == 1 and "collective" not in d.culprit


@pytest.mark.parametrize("ranks, want", [
    ((op(30, "aten.mm", 2.0, INF), op(30, "aten.mm", 3.0, INF)), 0),   # same op on both: the lowest rank
    ((op(40, "aten.mm", 2.0, INF), op(30, "aten.bmm", 3.0, INF)), 1),  # the earliest op wins over the rank
])
def test_the_culprit_is_the_earliest_op_then_the_lowest_rank(ranks, want):
    fp32 = [run(), run()]
    low = [run(False, first=r) for r in ranks]
    d = decide({"float32": fp32, "float16": low}, "float16", [])
    assert d.verdict == "overflow" and d.culprit["rank"] == want


def test_a_nan_from_finite_inputs_in_low_precision_is_left_to_the_one_process_replay():
    low = [run(False, first=op(30, "aten.sub", 2.0, NAN)), run()]
    d = decide({"float32": [run(), run()], "float16": low}, "float16", [])
    assert d.verdict == "not_classified" and "--rank 0" in d.notes[0]


def test_broken_inputs_make_nonfinite_input_whatever_the_runs_did():
    low = [run(False, first_input=op(27, "aten.t", INF, INF)), run(False, first_input=op(27, "aten.t", INF, INF))]
    d = decide({"float32": low, "float16": low}, "float16", ["param:0.weight"])
    assert d.verdict == "nonfinite_input" and d.culprit["op"] == "aten.t" and d.culprit["input"] == "param:0.weight"


def test_every_rank_finite_in_every_precision_is_healthy():
    assert decide({"float32": [run(), run()], "float16": [run(), run()]}, "float16", []).verdict == "healthy"

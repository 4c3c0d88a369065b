"""Which fixes the registry plans for which kind of culprit (``FixSpec.acts_on``): an op of the model gets the
fixes that hook a module, an op or the precision; a collective (the distributed replay's reduction that left
``reduce_dtype``'s range) gets only ``reduce_fp32``. The distributed runs themselves are in
``tests/test_distributed_replay.py`` and ``tests/test_ddp_replay.py``."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from analyzer.replay import FIXES, FixSpec
from analyzer.replay.fixes.registry import culprit_kind, plan


@dataclass(frozen=True)
class _Agreed:
    """What ``plan`` reads of a result: the verdict and the culprit the ranks agreed on (``agree.decide``)."""

    verdict: str
    culprit: dict | None


def _reduction(reduce_dtype: str) -> dict:
    # the fields agree.decide gives a collective's culprit (tests/fsdp_reduce_runs.py's reduce-scatter)
    return {"op": "c10d._reduce_scatter_base_", "module": "2", "phase": "backward", "precision": "float16",
            "index": 40, "rank": 0, "input_absmax": 4.03e4, "output_absmax": float("inf"),
            "collective": {"ordinal": 1, "reduce_dtype": reduce_dtype, "fp32_output_absmax": 8.06e4,
                           "ranks": [{"rank": 0, "input_absmax": 4.03e4, "output_absmax": float("inf")},
                                     {"rank": 1, "input_absmax": 4.03e4, "output_absmax": 0.0}]}}


def test_a_reductions_overflow_is_planned_reduce_fp32_and_none_of_the_model_op_fixes():
    r = _Agreed("overflow", _reduction("float16"))
    assert culprit_kind(r.culprit) == "collective"
    assert [s.name for s in plan(r)] == ["reduce_fp32"]


def test_a_reduction_already_in_fp32_gets_no_fix_planned():
    assert plan(_Agreed("overflow", _reduction("float32"))) == []


def test_an_ops_overflow_in_one_process_is_planned_the_model_op_fixes_and_never_reduce_fp32(fp16_attention_replay):
    r = fp16_attention_replay
    assert r.verdict == "overflow" and culprit_kind(r.culprit) == "op"
    names = [s.name for s in plan(r)]
    assert "op_fp32" in names and "reduce_fp32" not in names


def test_every_built_in_fix_but_reduce_fp32_acts_on_an_op_of_the_model():
    assert {n for n, s in FIXES.items() if "collective" in s.acts_on} == {"reduce_fp32"}
    assert FIXES["reduce_fp32"].acts_on == ("collective",)


@pytest.mark.parametrize("acts_on", [(), ("module",), ("op", "rank")])
def test_a_fix_acting_on_an_unknown_kind_of_culprit_is_refused(acts_on):
    with pytest.raises(ValueError, match="acts_on"):
        FixSpec("kind_test", "a test fix", lambda ctx, result: None, serves=("overflow",), acts_on=acts_on)

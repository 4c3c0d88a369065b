"""A NaN/Inf born in an ordinary op under torchrun: the one-process replay's answer and fixes, reached on every rank.

The runs (``tests/fsdp_op_runs.py``, 2 ranks, gloo, CPU) fail on rank 1 only: ``log0`` (an exact zero into
``aten.log`` in the loss, FP32 too), ``overflow`` (the first Linear's FP16 addmm) and ``accum`` (the same
overflow in the second of two micro-batches, accumulated with ``set_requires_gradient_sync(False)``, and
``accum_plain``, accumulated without it). The
distributed replay must give what ``analyzer replay SNAPSHOT --rank 1`` and its fixes give: verdict, op,
module, phase, summary, and each fix's name and status, agreed on every rank.
"""
from __future__ import annotations

import json

import pytest

from analyzer.replay import Replay
from tests import fsdp_op_runs as ops
from tests import fsdp_runs as fr
from tests.test_distributed_replay import errors, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not fr.fsdp_available(), reason="needs FSDP2, DCP and gloo")]

SNAP = "step00000000-r00001-nonfinite_loss.pt"  # rank 1's snapshot: the rank whose op made the NaN/Inf


@pytest.fixture(scope="module")
def op_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("op_runs")
    return {kind: ops.record_op_run(root, kind) for kind in ops.KINDS}


@pytest.fixture(scope="module")
def answers(op_runs):
    """Per run kind: the torchrun replay's --json (named by rank 0's snapshot) and the one-process replay of rank 1."""
    out = {}
    for kind, run in op_runs.items():
        proc = torchrun(2, "replay", str(run / "snapshots" / "step00000000-r00000-nonfinite_grads.pt"), "--json")
        assert proc.returncode == 0 and not errors(proc), proc.stderr[-3000:]
        one = Replay(run / "snapshots" / SNAP)
        result = one.run()
        out[kind] = (json.loads(proc.stdout), result, one.try_fixes(result))
    return out


@pytest.mark.parametrize("kind, verdict, op, module", [
    ("log0", "numerical_bug", "aten.log", "<loss_fn>"),     # log(0) is -inf in FP32 as well
    ("overflow", "overflow", "aten.addmm", "0"),            # 6e4-valued inputs: the FP16 sum reaches ~7e4
    ("accum", "overflow", "aten.addmm", "0"),               # the same, in micro-batch 1 of 2
    ("accum_plain", "overflow", "aten.addmm", "0"),         # the same, each micro-batch reduced in training
])
def test_torchrun_gives_the_one_process_verdict_op_module_and_summary_of_the_culprit_rank(answers, kind, verdict,
                                                                                          op, module):
    dist, one, _ = answers[kind]
    assert dist["verdict"] == one.verdict == verdict
    c = dist["culprit"]
    assert (c["op"], c["module"], c["phase"], c["rank"]) == (one.culprit["op"], one.culprit["module"],
                                                             one.culprit["phase"], 1) == (op, module, "forward", 1)
    assert dist["summary"].startswith(one.summary) and "rank 1's step" in dist["summary"]
    assert dist["replay"]["culprit"]["shadow"] == one.to_dict()["culprit"]["shadow"]
    assert "hidden" not in dist["replay"]["culprit"] or dist["replay"]["culprit"]["hidden"] is None


@pytest.mark.parametrize("kind", ["log0", "overflow", "accum", "accum_plain"])
def test_torchrun_tries_the_one_process_fixes_and_reaches_their_statuses_on_every_rank(answers, kind):
    dist, _, fixes = answers[kind]
    assert [(f["name"], f["status"]) for f in dist["fixes"]] == [(f.name, f.status) for f in fixes]
    assert len(dist["fixes"]) >= 2
    # each status is the one every rank reached (the ranks agree; a rank that differs would be named)
    assert all("on each of the 2 ranks" in f["detail"] for f in dist["fixes"])


def test_a_verified_bf16_fix_under_torchrun_is_judged_against_the_fp32_run_not_on_finiteness(answers):
    dist, _, _ = answers["overflow"]
    bf16 = next(f for f in dist["fixes"] if f["name"] == "bf16")
    assert bf16["status"] == "verified" and bf16["reference_loss"] is not None
    # rank 1's FP32 loss: the sum of ~-8.6e4 outputs; BF16's within the 1e-2 tolerance of it
    assert abs(bf16["loss"] - bf16["reference_loss"]) <= 1e-2 * abs(bf16["reference_loss"])
    assert dist["advice"][0].startswith("[verified] Use MixedPrecisionPolicy(param_dtype=torch.bfloat16)")


def test_the_accumulated_step_is_replayed_micro_batch_by_micro_batch_reducing_once_under_torchrun(answers):
    dist, one, _ = answers["accum"]
    # two sharded modules hold parameters (0 and 2; the root none): one reduce-scatter each per step, as the
    # loop's set_requires_gradient_sync(False) on the first micro-batch had it, and as the step without
    # accumulation has; every micro-batch's forward and backward all-gather again (twice the step's)
    for p in ("float32", "float16"):
        for rank in (0, 1):
            got, single = dist["runs"][p][rank]["collectives"], answers["overflow"][0]["runs"][p][rank]["collectives"]
            assert got["c10d._reduce_scatter_base_"] == single["c10d._reduce_scatter_base_"] == 2
            assert got["c10d._allgather_base_"] == 2 * single["c10d._allgather_base_"]
    assert dist["replay"]["micro_batches"]["count"] == 2
    assert dist["replay"]["culprit"]["micro_batch"] == one.to_dict()["culprit"]["micro_batch"] == 1
    assert "micro-batch 1 (0-based) of the 2" in dist["summary"]


def test_the_text_answer_of_a_classified_culprit_shows_the_rank_and_the_fixes_tried_on_every_rank(op_runs):
    proc = torchrun(2, "replay", str(op_runs["log0"] / "snapshots" / SNAP))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("verdict: numerical_bug")
    assert "the culprit ran on rank 1" in out and "fixes tried on every rank:" in out
    assert "gradients reduced across ranks in the recorded reduce_dtype" in out
    assert "[verified] guard log at tests/fsdp_op_runs.py" in out


def test_ranks_whose_steps_run_different_ops_stop_with_one_error_line_naming_the_one_process_replay(op_runs):
    proc = torchrun(2, "replay", str(op_runs["overflow"] / "snapshots" / SNAP), "--loss-fn",
                    "tests.fsdp_op_runs:sum_loss_rank_1_runs_more_ops", timeout_env="60")
    lines = errors(proc)
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    assert "diverged" in lines[0] and "ran different ops" in lines[0]
    assert "analyzer replay SNAPSHOT --rank 1" in lines[0]

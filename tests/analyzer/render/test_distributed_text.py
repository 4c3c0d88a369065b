"""``render_distributed_text``: the distributed replay's answer as rank 0 prints it, from a real decision.

The decision comes from ``agree.decide`` on summaries shaped as ``agree.summarize`` makes them (the
reduce-scatter overflow of ``tests/fsdp_reduce_runs.py``, its numbers); the end-to-end text is exercised
under torchrun in ``tests/test_distributed_replay.py``.
"""
from __future__ import annotations

import math

from analyzer.render.distributed import render_distributed_text
from analyzer.replay.distributed import DistributedResult, decide
from analyzer.replay.fixes.registry import Fix

RS = "c10d._reduce_scatter_base_"


def _rs(inp, out, dtype):
    return {"op": RS, "overload": "default", "module": "2", "phase": "backward", "index": 112, "source": None,
            "precision": dtype, "input_dtypes": [dtype], "output_dtype": dtype, "input_absmax": inp,
            "output_absmax": out}


def _run(finite, call):
    return {"precision": call["precision"], "loss": -12922.2, "forward_finite": True, "grads_finite": finite,
            "grad_absmax": 1.0, "finite": finite, "ops": 200, "first": None, "first_input": None,
            "collectives": [call]}


def test_the_text_names_the_reduction_every_ranks_input_and_the_reduced_value():
    fp32 = [_run(True, _rs(40320.0, 80640.0, "float32")), _run(True, _rs(40320.0, 0.0, "float32"))]
    low = [_run(False, _rs(40320.0, math.inf, "float16")), _run(True, _rs(40320.0, 0.0, "float16"))]
    d = decide({"float32": fp32, "float16": low}, "float16", [])
    fix = Fix(name="reduce_fp32", title="reduce_dtype=torch.float32 in every MixedPrecisionPolicy",
              status="verified", detail="every rank's loss and gradients are finite")
    runs = {p: [{k: s[k] for k in ("loss", "forward_finite", "grads_finite", "grad_absmax")} for s in ss]
            for p, ss in (("float32", fp32), ("float16", low))}
    r = DistributedResult(verdict=d.verdict, culprit=d.culprit, runs=runs, snapshot="s.pt", step=0,
                          reason="nonfinite_grads", world_size=2, recorded_world_size=2,
                          precision_mode="fsdp_param_dtype", precision_dtype="float16", device="cpu", fixes=[fix])
    text = render_distributed_text(r)
    assert text.startswith("verdict: overflow")
    assert "rank 0: input abs-max 4.032e+04  reduced abs-max inf" in text
    assert "rank 1: input abs-max 4.032e+04  reduced abs-max 0" in text
    assert "(reduced in float16; FP32 run: 8.064e+04)" in text
    assert "float16   rank 0  loss -1.292e+04  gradients NaN/Inf" in text
    assert "[verified] reduce_dtype=torch.float32" in text
    assert r.to_dict()["culprit"]["collective"]["ranks"][0]["output_absmax"] == "inf"

"""``CastWatch``: an FP8 cast's saturation is counted on the values before the clamp, not read from its result."""
from __future__ import annotations

import torch

from analyzer.replay.runs._mode import _OpStatsMode
from analyzer.replay.fp8.casts import CastWatch, dequantised


def test_a_static_scale_cast_counts_saturation_before_the_clamp_and_flush_and_subnormals():
    x = torch.tensor([[1.0, 100.0, 200.0, 0.001, 0.0001, 0.0]])
    scale = torch.tensor(4.0)  # a static scale set for |x| <= 112: it does not cover 200
    watch = CastWatch()
    with _OpStatsMode(casts=watch):
        q = (x * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    # torch 2.13's CPU cast saturates: 800 became 448, the cast's result shows no overflow
    assert q.float().abs().max().item() == 448.0
    (c,) = watch.finalize()
    s = c.stats
    # x * 4 = [4, 400, 800, 0.004, 0.0004, 0]: 800 > 448 saturates; 0.004 is an e4m3 subnormal
    # (below 2**-6, above 2**-10); 0.0004 is below half the smallest subnormal (2**-9) and flushes
    assert (s.numel, s.nonzero, s.saturated, s.subnormal, s.flushed) == (6, 5, 1, 1, 1)
    assert c.outlier == (0, 2) and c.fmt == "e4m3" and c.granularity == "tensorwise" and c.role is None


def test_a_cast_without_a_scale_the_step_computed_is_not_a_training_cast():
    watch = CastWatch()
    with _OpStatsMode(casts=watch):
        torch.randn(4, 4).to(torch.float8_e5m2)
    assert watch.finalize() == []


def test_the_dispatch_mode_reads_float8_outputs_dequantised():
    mode = _OpStatsMode()
    with mode:
        q = torch.tensor([3.0, -500.0]).to(torch.float8_e5m2)
    absmax, _ = mode.finalize()
    assert dequantised(q).tolist() == [3.0, -512.0]  # e5m2 rounds 500 to 512
    assert absmax[mode.records[-1].outputs[0]] == 512.0


def test_a_saturating_cast_in_a_step_that_leaves_bf16_refines_healthy_to_fp8_saturation():
    import dataclasses

    from analyzer.replay.verdicts import registry as verdicts
    from analyzer.replay.result.diagnosis import Diagnosis
    from analyzer.replay.fp8.diagnose import Fp8Evidence, Judgement
    from analyzer.replay.fp8.step import agreement

    x = torch.linspace(-300.0, 300.0, 64).reshape(4, 16)
    watch = CastWatch()
    with _OpStatsMode(casts=watch):  # a stale scale (set when |x| was 112) on an e4m3 gradient
        (x * torch.tensor(4.0)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    (cast,) = watch.finalize()
    cast = dataclasses.replace(cast, module="fc", role="grad_output", use="input gradient", phase="backward")
    ref = {"fc.weight": torch.ones(8)}
    bad = Judgement(tuple(agreement({"fc.weight": -torch.ones(8)}, ref)), {"fc": 1.0})  # cosine -1
    good = Judgement(tuple(agreement(ref, ref)), {"fc": 0.0})
    ev = Fp8Evidence(roles={}, modules=("fc",), precision="bfloat16", losses={}, casts=(cast,), vs_bf16=bad,
                     vs_fp32=bad, bf16_vs_fp32=good, nonfinite_at=None, reference=None)
    d = verdicts.refine(Diagnosis("healthy", evidence={"fp8": ev}))
    assert d.verdict == "fp8_saturation"
    # |x * 4| > 448 for |x| > 112: 40 of the 64 values of linspace(-300, 300) (20 on each side)
    assert cast.stats.saturated == 40 and "saturated 40 of 64 values" in verdicts.summary(d)
    assert [line.fixes for line in verdicts.VERDICTS[d.verdict].advice(d)][0] == ("fp8_e5m2_grads",)
    # the same cast in a step that still agrees with BF16: reported, not a verdict
    assert verdicts.refine(Diagnosis("healthy", evidence={"fp8": dataclasses.replace(ev, vs_bf16=good)})).verdict == "healthy"

"""The compiled re-run is the registered probe ``compiled`` (last in ``probes.registry.ORDER``), and
``compile_specific`` is a registered refinement of whatever the eager runs reached, detected in that
probe's evidence and worded from it alone.

The eager side is a real replay (``fp16_attention_replay``: an FP16 attention overflow, with its
probes' evidence); the compiled side is a ``CompiledRun`` value as ``compiled_run`` returns it (the
real compiled runs are ``test_compiled_replay.py``'s, marked ``compile``).
"""
from __future__ import annotations

import dataclasses
import math

from analyzer.replay.verdicts import registry as verdicts
from analyzer.replay.compiled.replay import CompiledRun
from analyzer.replay.result.diagnosis import Diagnosis
from analyzer.replay.probes import ORDER, PROBES
from analyzer.replay.probes.micro_batch import MicroBatch
from analyzer.replay.result.records import Culprit


def _info(**extra) -> dict:
    """A compiled-only failure's ``compiled`` object, as ``compiled_run`` writes it."""
    return {"modules": [{"backend": "inductor"}], "precision": "float16", "scale": 1.0, "backend": "inductor",
            "reproduced": True, "finite": False, "loss": math.nan, "forward_finite": False,
            "backward_finite": False, "grad_absmax": None, "eager_finite": True, "random": None,
            "module": "attn", "phase": "forward", "leaf": True, "tried": [], "stopped": False, "kernel": None,
            "kernel_note": "no Inductor kernel's output was NaN/Inf", "ops": [],
            "note": "the compiled step is non-finite; the eager step is finite", **extra}


def _compiled_culprit(micro_batch: int | None = None) -> Culprit:
    c = Culprit(op="<compiled>", overload="", module="attn", phase="forward", precision="float16", index=-1,
                source=None, node=None, input_dtypes=[], output_dtype="float16", input_absmax=None,
                output_absmax=None, output_kind="nan", custom=False)
    return c if micro_batch is None else dataclasses.replace(c, micro_batch=micro_batch)


def test_the_compiled_re_run_is_a_registered_probe_run_last():
    assert "compiled" in PROBES and ORDER[-1] == "compiled" and list(PROBES)[-1] == "compiled"
    assert PROBES["compiled"].into is None  # --json's compiled key is the result's own, null for an eager model


def test_a_compiled_step_that_disagrees_refines_the_eager_verdict_into_compile_specific(fp16_attention_replay):
    eager = fp16_attention_replay.diagnosis
    assert eager.verdict == "overflow" and eager.evidence  # the eager overflow, with its probes' evidence
    ev = CompiledRun(_info(), specific=True, culprit=_compiled_culprit())
    d = verdicts.refine(dataclasses.replace(eager, evidence={**eager.evidence, "compiled": ev}))
    assert d.verdict == "compile_specific" and d.culprit is ev.culprit and d.trace is None
    assert dict(d.evidence) == {"compiled": ev}  # the evidence about the eager culprit went with it
    assert d.nonfinite_inputs == eager.nonfinite_inputs and d.context_ops == eager.context_ops  # eager's facts stay
    text = verdicts.summary(d)
    assert text.startswith("The compiled step is non-finite in float16 (the loss) while the eager step is finite: "
                           "compiling `attn` alone")
    assert not any(n.note() in text for n in eager.evidence.values() if getattr(n, "note", None) and n.note())
    assert [a.fixes for a in verdicts.advice(d)][0] == ("compile_disable",)


def test_compile_specific_comes_before_the_refinements_of_a_healthy_step():
    ev = CompiledRun(_info(), specific=True, culprit=_compiled_culprit())
    healthy = Diagnosis("healthy", evidence={"random_draws": object(), "compiled": ev})
    assert verdicts.refine(healthy).verdict == "compile_specific"  # not not_reproduced, which also detects here
    agrees = Diagnosis("healthy", evidence={"random_draws": object(), "compiled": CompiledRun(_info())})
    assert verdicts.refine(agrees).verdict == "not_reproduced"  # a compiled run that agrees leaves the rest to decide


def test_the_compiled_micro_batch_is_the_summary_s_last_sentence_and_a_culprit_field(fp16_attention_replay):
    eager = fp16_attention_replay.diagnosis
    ev = CompiledRun(_info(), specific=True, culprit=_compiled_culprit(1), micro=MicroBatch(1, 3))
    d = verdicts.refine(dataclasses.replace(eager, evidence={**eager.evidence, "compiled": ev}))
    assert dict(d.evidence) == {"compiled": ev, "micro_batch": ev.micro}
    assert verdicts.summary(d).endswith(" It is in micro-batch 1 (0-based) of the 3 this step accumulated.")
    assert ev.note() is None  # the micro-batch evidence says it, once

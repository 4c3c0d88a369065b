"""A compiled model's replay: the failing precision compiled as training compiled it, against the eager runs.

``compiled_run`` (the work of the ``compiled`` probe, ``probes/compiled.py``) runs the step once more
with the snapshot's ``compile`` entry applied (``_run``) and compares it with the eager run of the same
precision; its ``CompiledRun`` evidence is what the verdict and ``--json``'s ``compiled`` read:

- both non-finite, or both finite: the eager verdict stands (``compiled`` says the compiled run agreed);
- they disagree (``CompiledRun.specific``): verdict ``compile_specific`` (``verdict``), which refines
  whatever the eager runs reached. A compiled-only failure is
  localized to the smallest module (``_localize``), which becomes the culprit (op
  ``<compiled>``, index -1: no eager op is blamed); an eager-only failure keeps no culprit, and
  its eager origin is kept as ``compiled["eager_only"]``;
- the compiled step cannot be built or run here (no C++ compiler, Inductor failing to build a
  kernel, an unknown backend): the eager verdict stands, and ``compiled`` says "compiled step not
  reproduced" and why, in one line.

The run of the whole step is watched (``_kernel_watch``): a compiled-only failure also names the
first Inductor kernel whose output holds NaN/Inf, with its ATen ops and source lines
(``compiled["kernel"]``). A step that draws random numbers (dropout) is run compiled twice: from
the snapshot's RNG state with Inductor's RNG, as training drew its masks (the top-level fields), and
with eager's masks (``fallback_random``, ``compiled["random"]["same_masks"]``), which is what the
eager replay is compared with, and what the module search and the fix draw: a mask difference is
never taken for compile numerics, and when the masks alone decide finiteness the summary says so.

The per-op view (``runs``, the culprit's ops, the plot) stays the eager one.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..runs._runs import ReplayContext
from ..result.diagnosis import Diagnosis
from ..probes.micro_batch import MicroBatch
from ..result.records import Culprit
from ..result.trace import RunTrace
from ._localize import localize
from ._run import CompiledOnce, compiled_once
from .verdict import masks_sentence

__all__ = ["CompiledRun", "compiled_run", "NOT_REPRODUCED"]

NOT_REPRODUCED = "compiled step not reproduced"


def compiled_run(ctx: ReplayContext, entry: dict, runs: Mapping[str, RunTrace], eager: Diagnosis) -> CompiledRun:
    """The step of the failing precision compiled as `entry` (the snapshot's ``compile``) says training compiled
    it, against the eager `runs` and their diagnosis `eager` (refined; see the module doc).

    NB: each compiled run resets TorchDynamo's caches (``torch._dynamo.reset``) before and after it.
    """
    fork = [ctx.device.index or 0] if ctx.device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork):  # the caller's RNG is left as it was
        return _compiled_run(ctx, entry, runs, eager)


def _compiled_run(ctx: ReplayContext, entry: dict, runs: Mapping[str, RunTrace], eager: Diagnosis) -> CompiledRun:
    modules = list(entry["modules"])
    prec = ctx.mode.dtype or "float32"  # the precision training ran (its low precision, else FP32)
    scale = eager.scale
    info: dict = {"modules": modules, "precision": prec, "scale": scale,
                  "backend": modules[0].get("backend") or "inductor"}
    t0 = time.perf_counter()
    full = compiled_once(ctx, modules, prec, scale, watch=True)
    if full.trace is None:
        info.update(reproduced=False, note=f"{NOT_REPRODUCED}: {full.error}; the eager verdict stands",
                    seconds=round(time.perf_counter() - t0, 2))
        return CompiledRun(info)
    run = full.trace
    if ctx.micro is not None:  # every micro-batch ran compiled; the first after which the step was non-finite
        info.update(micro_batches=ctx.micro["count"], micro_batch=full.micro_batch)
    same = compiled_once(ctx, modules, prec, scale, watch=True, same_masks=True) if full.drew_random else None
    compared = same if same is not None and same.trace is not None else full  # what eager is compared with
    trace = runs.get(prec)
    c, e = _side(compared.trace), (_side(trace) if trace is not None else (0 if eager.verdict == "healthy" else 2))
    info.update(reproduced=True, **_run_fields(run), eager_finite=e == 0,
                random=None if same is None else _random_info(run, same))
    masks = masks_sentence(info)
    if c < e and (c == 0 or e == 2):  # eager-only: training's compiled step (or its forward) is finite
        info.update(eager_only=_eager_origin(eager), note="the compiled step is finite; the eager NaN/Inf is "
                    "eager-only", seconds=round(time.perf_counter() - t0, 2))
        return CompiledRun(info, specific=True)
    if not (c == 2 and e < 2 or c == 1 and e == 0):  # both fail (or neither) the same way: the verdict stands
        agree = "finite" if c == 0 else "non-finite"
        same_masks = " with eager's dropout masks" if same is not None else ""
        info.update(note=f"the compiled step{same_masks} is {agree} too: the eager verdict stands" + (
                    f"; {masks}" if masks else ""), seconds=round(time.perf_counter() - t0, 2))
        return CompiledRun(info)
    phase = "forward" if not compared.trace.forward_finite else "backward"
    found = localize(ctx, modules, prec, scale, phase, same_masks=same is not None)
    module = found.module
    leaf = module is not None and not any(True for _ in ctx.build_model(prec).get_submodule(module).children())
    info.update(module=module, phase=found.phase or phase, leaf=leaf, tried=found.tried, stopped=found.stopped,
                **_kernel_fields(compared.kernels), note="the compiled step is non-finite; the eager step is finite",
                seconds=round(time.perf_counter() - t0, 2))
    if module is not None:
        info["ops"] = _module_ops(trace, module, info["phase"])
    culprit = None if module is None else _culprit(module, info["phase"], prec, run, compared.micro_batch)
    micro = None if culprit is None or ctx.micro is None else culprit.get("micro_batch")
    return CompiledRun(info, specific=True, culprit=culprit,
                       micro=None if micro is None else MicroBatch(micro, ctx.micro["count"]))


@dataclass(frozen=True)
class CompiledRun:
    """Evidence: the step compiled as training compiled it, against the eager runs (``--json``'s ``compiled``).

    Attributes:
        info: the ``compiled`` object of ``--json`` (the module doc says its fields).
        specific: the compiled step and the eager one disagree about finiteness: ``compile_specific``.
        culprit: the compiled module blamed (op ``<compiled>``), that verdict's culprit; None otherwise.
        micro: with accumulation, the micro-batch after which the compiled step was first non-finite.
    """

    info: Mapping[str, Any]
    specific: bool = False
    culprit: Culprit | None = None
    micro: MicroBatch | None = None

    def to_dict(self) -> dict:
        return {"compiled": dict(self.info)}

    def note(self) -> str | None:
        """Where the eager verdict stands: when training's dropout masks and eager's decide finiteness
        differently, say so. None for ``compile_specific``: its summary says it itself, and the micro-batch
        evidence it keeps (``micro``) names the micro-batch."""
        if self.specific:
            return None
        masks = masks_sentence(self.info)
        return f"{masks[0].upper()}{masks[1:]}." if masks else None


def _random_info(run: RunTrace, same: CompiledOnce) -> dict:
    """A step that draws random numbers: its compiled run with eager's masks, and whether masks decide finiteness."""
    if same.trace is None:
        return {"same_masks": None, "masks_matter": None,
                "note": f"the compiled step with eager's dropout masks could not run: {same.error}"}
    return {"same_masks": _run_fields(same.trace), "masks_matter": _side(run) != _side(same.trace),
            "note": "the step draws random numbers: the compiled run from the snapshot's RNG state draws training's "
                    "(Inductor's RNG); eager is compared with the step compiled with eager's (fallback_random)"}


def _kernel_fields(kernels: dict | None) -> dict:
    """``kernel`` (the first non-finite Inductor kernel, or None) and ``kernel_note`` (how it was found, or why not)."""
    if kernels is None or kernels["unavailable"]:
        why = kernels["unavailable"] if kernels else "the compiled run was not watched"
        return {"kernel": None, "kernel_note": f"{why}: the module is the finest place named"}
    first, n = kernels["first"], kernels["checked"]
    if kernels["graphs"] == 0:
        return {"kernel": None, "kernel_note": "no Inductor-generated code ran in the compiled step (another "
                "backend, or no kernel to generate): the module is the finest place named"}
    if first is None:
        return {"kernel": None, "kernel_note": f"no Inductor kernel's output was NaN/Inf ({n} kernel calls checked): "
                "the NaN/Inf arises outside the compiled kernels (an eager part of the step)"}
    graph = f"graph {first['aot_id']}" if first.get("aot_id") else f"a {first['graph']} graph"
    if first["where"] == "input":
        return {"kernel": None, "kernel_note": f"{graph}'s input was already NaN/Inf: it came from eager code "
                "between compiled graphs"}
    other = (f"one of the {kernels['unwatched']} Triton kernels (not watched)" if kernels["unwatched"] else
             "an op Inductor left to eager (a fallback, not watched)")
    if first["where"] == "output":
        return {"kernel": None, "kernel_note": f"{graph}'s output is NaN/Inf while no watched kernel's is: {other} "
                "made it"}
    how = "from finite inputs" if first["inputs_finite"] else f"its inputs already NaN/Inf from {other}"
    return {"kernel": first, "kernel_note": f"the first of {n} kernel calls, in call order, whose output holds "
            f"NaN/Inf ({how}), in the compiled run of the whole step"}


def _module_ops(trace: RunTrace | None, module: str, phase: str, limit: int = 16) -> list[dict]:
    """The distinct ops `module` (and its children) ran in `phase` of the eager trace: what its compiled
    version computes, in eager's terms (Inductor's kernels themselves are not observed)."""
    out: list[dict] = []
    seen: set = set()
    for rec in trace.records if trace is not None else []:
        m = rec.module or ""
        if rec.phase != phase or (module and m != module and not m.startswith(module + ".")):
            continue
        if (rec.name, m, rec.source) not in seen and len(out) < limit:
            seen.add((rec.name, m, rec.source))
            out.append({"op": rec.name, "module": m, "source": rec.source})
    return out


def _side(run: RunTrace) -> int:
    """0 finite, 1 only a gradient non-finite (at the run's loss scale), 2 the loss non-finite."""
    return 0 if run.finite else (1 if run.forward_finite else 2)


def _run_fields(run: RunTrace) -> dict:
    return {"finite": run.finite, "loss": run.loss, "forward_finite": run.forward_finite,
            "backward_finite": run.grads_finite, "grad_absmax": run.grad_absmax}


def _eager_origin(eager: Diagnosis) -> dict:
    c = eager.culprit
    if c is None:
        return {"verdict": eager.verdict, "op": "an input", "module": "-", "phase": "-", "source": None}
    return {"verdict": eager.verdict, "op": c["op"], "module": c["module"], "phase": c["phase"],
            "precision": c["precision"], "index": c["index"], "source": c.get("source")}


def _culprit(module: str, phase: str, prec: str, run: RunTrace, micro_batch: int | None) -> Culprit:
    """The compiled module blamed, as a culprit: no eager op, so op ``<compiled>`` and index -1; with
    accumulation, the micro-batch after which the compiled step was first non-finite."""
    kind = "inf" if phase == "forward" and math.isinf(run.loss) else "nan"
    culprit = Culprit(op="<compiled>", overload="", module=module, phase=phase, precision=prec, index=-1,
                      source=None, node=None, input_dtypes=[], output_dtype=prec, input_absmax=None,
                      output_absmax=None, output_kind=kind, custom=False)
    return culprit if micro_batch is None else dataclasses.replace(culprit, micro_batch=micro_batch)

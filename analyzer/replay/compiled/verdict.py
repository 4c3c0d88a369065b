"""The ``compile_specific`` verdict: the compiled step and the eager replay disagree about finiteness.

It refines any verdict the eager runs reach (``refines=(ANY,)``, first in ``verdicts.ORDER``: the
compiled step is what training ran), detected in the ``compiled`` probe's evidence
(``Diagnosis.evidence["compiled"]``, ``compiled.replay.CompiledRun``), whose ``specific`` says the
two disagree. Two ways:

- compiled non-finite, eager finite: the culprit is the smallest module whose compiled version
  alone makes the step non-finite (``_localize``); the fix tried is that module excluded
  from compilation (``compile_disable``).
- eager non-finite, compiled finite: training's compiled step is finite; the eager replay's
  NaN/Inf is eager-only (Inductor keeps a fused chain's intermediates in FP32 and rounds once),
  named as such and never as the run's failure.

The compiled-only case names, where Inductor's generated code allows (``_kernel_watch``), the
first kernel whose output holds NaN/Inf, with the ATen ops it fuses and their source lines.

Examples of a summary:
    Training's compiled step is finite in float16 (loss 0.4121, every gradient finite). The eager
    replay's overflow at aten.mul in `scale` (forward) is eager-only: Inductor computes this fused
    chain in FP32 and rounds its result once.

    The compiled step is non-finite in float16 (the loss) while the eager step is finite: compiling
    `gate` alone (the rest eager) makes it non-finite, while none of its child modules does alone.
    In the compiled step, the first kernel whose output holds NaN/Inf is
    cpp_fused__to_copy_mul_pow_rsub_1 (forward graph, from finite inputs): aten.mul, aten.sub,
    aten.pow at tests/analyzer/replay/compile_models.py:37, :38, :48. Its forward arithmetic, ...

A step that draws random numbers (dropout) is compared with eager under eager's masks; when
training's masks and eager's decide finiteness differently, the summary says so.
"""
from __future__ import annotations

from ..result.diagnosis import Diagnosis
from ..verdicts.registry import ANY, AdviceLine, Verdict, register

__all__ = ["COMPILE_SPECIFIC", "masks_sentence"]

COMPILE_SPECIFIC = "compile_specific"


def masks_sentence(info: dict) -> str | None:
    """When training's masks and eager's give the compiled step a different finiteness, say so (else None)."""
    r = info.get("random")
    if not r or not r.get("masks_matter"):
        return None
    state = lambda f: "finite" if f["finite"] else "non-finite"  # noqa: E731
    return (f"training's compiled step, with its own dropout masks (Inductor's RNG), is {state(info)}, and "
            f"{state(r['same_masks'])} with eager's masks: which elements dropout drops decides it, not "
            "compilation (the eager replay cannot draw Inductor's masks)")


def _where(module: str | None) -> str:
    return "the whole model" if module == "" else f"`{module}`"


def _eager_only(c: dict) -> str:
    e = c["eager_only"]
    src = f" at {e['source']}" if e.get("source") else ""
    return f"{e['verdict']} at {e['op']} in `{e['module']}` ({e['phase']}){src}"


def _why(c: dict) -> str:
    if c.get("backend") == "inductor":
        return "Inductor computes this fused chain in FP32 and rounds its result once"
    return f"the {c.get('backend')} backend computes it differently from eager"


_LAYOUT = frozenset({"aten._to_copy", "aten.t", "aten.view", "aten._unsafe_view", "aten.expand", "aten.transpose",
                     "aten.permute", "aten.reshape", "aten.detach", "aten.clone", "aten.alias", "aten.unsqueeze",
                     "aten.squeeze", "aten.slice", "aten.select", "aten.copy_", "aten.empty_like"})


def _ops_by_line(ops: list[dict], lines: int = 4) -> str:
    """``file:28 (aten.mm, aten.mul); file:29 (aten.mul, aten.rsub, aten.pow)``: casts and views left out."""
    by: dict[str, list[str]] = {}
    for o in ops:
        if o["op"] not in _LAYOUT and o["op"] not in by.setdefault(o.get("source") or "?", []):
            by[o.get("source") or "?"].append(o["op"])
    parts = [f"{src} ({', '.join(names)})" for src, names in by.items() if names]
    more = f" and {len(parts) - lines} more lines" if len(parts) > lines else ""
    return "; ".join(parts[:lines]) + more


def _info(d: Diagnosis) -> dict:
    """The compiled run's ``--json`` object, from the ``compiled`` probe's evidence."""
    return d.evidence["compiled"].info


def _summary(d: Diagnosis) -> str:
    c = _info(d)
    prec = c["precision"]
    masks = masks_sentence(c)
    masks = f" {masks[0].upper()}{masks[1:]}." if masks else ""
    if c.get("eager_only") is not None:
        same = (c.get("random") or {}).get("same_masks")
        run, who = (same, "The step compiled with eager's dropout masks") if masks else (c, "Training's compiled step")
        ran = ("every gradient finite" if run["finite"] else
               f"a gradient non-finite at loss scale {c['scale']:g}, a step GradScaler skips")
        return (f"{who} has a finite loss in {prec} ({run['loss']:.4g}; {ran}). "
                f"The eager replay's {_eager_only(c)} is eager-only: {_why(c)}.{masks}")
    what = "the loss" if c.get("phase") == "forward" else "a gradient"
    if c.get("module") is None:
        return (f"The compiled step is non-finite in {prec} ({what}) while the eager step is finite; no "
                "compiled module alone makes it non-finite, only the compiled modules together."
                f"{_kernel(c)}{masks}")
    kids = " (it has no child modules)" if c.get("leaf") else ", while none of its child modules does alone"
    if c.get("stopped"):
        kids = f" (the search stopped after {len(c['tried'])} compiled runs: a smaller module may fail too)"
    runs = _ops_by_line(c.get("ops") or [])
    runs = f" Its {c['phase']} arithmetic, as the eager trace records it: {runs}." if runs else ""
    return (f"The compiled step is non-finite in {prec} ({what}) while the eager step is finite: compiling "
            f"{_where(c['module'])} alone (the rest eager) makes it non-finite{kids}.{_kernel(c)}{runs}{masks}")


def _kernel(c: dict) -> str:
    """The first non-finite Inductor kernel, its ops and source lines (``_kernel_watch``), as a sentence."""
    k = c.get("kernel")
    if not k:
        return ""
    ops = ", ".join(o for o in k["ops"] if o not in _LAYOUT and o != "prims.convert_element_type")
    src = _lines(k["sources"])
    how = "from finite inputs" if k["inputs_finite"] else "its inputs already NaN/Inf"
    return (f" In the compiled step, the first kernel whose output holds NaN/Inf is {k['kernel']} "
            f"({k['graph']} graph, {how})"
            + (f": {ops}" if ops else "") + (f" at {src}" if src else "") + ".")


def _lines(sources: list[str]) -> str:
    """``a.py:28, :29; b.py:3``: one file name per run of lines in it."""
    parts: list[str] = []
    last = None
    for s in sources:
        file, _, line = s.rpartition(":")
        parts.append(f":{line}" if file == last else s)
        last = file
    return ", ".join(parts)


def _advice(d: Diagnosis) -> list[AdviceLine]:
    c = _info(d)
    if c.get("eager_only") is not None:
        e = c["eager_only"]
        return [AdviceLine("Nothing to fix in the compiled training step. Where this model runs eager "
                           f"(evaluation, export, a debug run), {e['op']} in `{e['module']}` is non-finite there: "
                           "keep that module in FP32 for those runs.")]
    if c.get("module") is None:
        return [AdviceLine("Compile fewer modules: the NaN/Inf needs several compiled modules together.")]
    m = c["module"]
    how = ("run the model eager (drop torch.compile)" if m == "" else
           f"decorate the forward of `{m}`'s class with @torch.compiler.disable, or compile its children only")
    return [AdviceLine(f"Exclude {_where(m)} from compilation: {how}.", fixes=("compile_disable",)),
            AdviceLine(f"Or keep {_where(m)}'s fused arithmetic in range: compiled, its intermediates are FP32 where "
                       f"eager rounds each op to {c['precision']}, so a value eager kept inside a domain "
                       "(sqrt, log, pow, acos) can leave it.")]


def _detect(d: Diagnosis) -> bool:
    ev = d.evidence.get("compiled")
    return ev is not None and ev.specific


def _amend(d: Diagnosis) -> dict:
    """The compiled module is the culprit (None: eager-only, or no module alone), with no eager trace; the
    evidence about the eager culprit goes with it, the compiled run's (and its micro-batch) stays. The eager
    runs' facts (the inputs, a hidden or literal NaN/Inf, the ops around the eager culprit) stay, as the
    eager replay found them."""
    ev = d.evidence["compiled"]
    kept = {"compiled": ev, **({"micro_batch": ev.micro} if ev.micro is not None else {})}
    return {"culprit": ev.culprit, "trace": None, "evidence": kept}


register(Verdict(
    COMPILE_SPECIFIC, "The step compiled as training compiled it and the eager replay disagree about "
    "finiteness: one of them is non-finite, the other finite.",
    summary=_summary, advice=_advice, fixes=("compile_disable",), refines=(ANY,), detect=_detect, amend=_amend))

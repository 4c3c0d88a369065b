"""The verdict registry: each verdict replay can reach, with its meaning, summary and advice.

A verdict is one frozen ``Verdict`` in ``VERDICTS``, found by name. Its ``summary`` and
``advice`` are functions of the ``Diagnosis``; each advice line is an ``AdviceLine`` that names
the fixes it recommends (``fixes.FIXES``), so a line is tied to its fixes by name, never by its
wording. The fixes tried for a verdict are those it names (``Verdict.fixes``, in that order),
then the other registered fixes that serve it (``FixSpec.serves``).

The built-in verdicts' sentences live in ``_builtin.py``, each registered beside its
functions (``cancellation`` in ``_cancellation.py``, ``compile_specific`` in ``compiled/verdict.py``);
``ORDER`` is their order, whichever module is imported first. Adding a verdict is one ``register(Verdict(...))`` plus its detection: either in
``_diagnose.diagnose``, or, for a verdict that narrows one the diagnosis already reached, a
``detect`` predicate on the ``Diagnosis`` and the verdicts it ``refines``:

    >>> register(Verdict(
    ...     "log_of_zero", "A log of an exact zero.",
    ...     summary=lambda d: f"{d.culprit['op']} in `{d.culprit['module']}` took the log of 0.",
    ...     advice=lambda d: [AdviceLine("Clamp the argument of log.", fixes=("guard_clamp",))],
    ...     fixes=("guard_clamp",), refines=("numerical_bug",),
    ...     detect=lambda d: d.culprit["op"] == "aten.log"))  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..detection._actionable import BATCH_FAULT_ADVICE, installed_line
from ..detection._magnitude import _THROUGH, _ancestors
from ..result.diagnosis import Diagnosis
from ..result.records import hidden_first

__all__ = ["ANY", "AdviceLine", "Verdict", "VERDICTS", "ORDER", "register", "in_order", "refine", "summary", "advice", "respect_runs",
           "PRECISION_FIXES", "loss_feeds_model", "from_model"]


@dataclass(frozen=True)
class AdviceLine:
    """One advice line and the names of the fixes (``fixes.FIXES``) it recommends.

    ``checked``: the line states what the replay's own values show (why a remedy is not offered,
    with its numbers), not something to try: it is printed as ``checked``, never as untested advice.
    """

    text: str
    fixes: tuple[str, ...] = ()
    checked: bool = False


@dataclass(frozen=True)
class Verdict:
    """One verdict.

    Attributes:
        name: the stable name (a public contract: ``--json``'s ``verdict``).
        meaning: one sentence saying what it means.
        summary: the one-sentence finding, from the diagnosis.
        advice: the advice lines, most specific first (empty texts are dropped).
        fixes: fixes tried for this verdict, in this order, before the other registered fixes
            that serve it (``FixSpec.serves``).
        refines / detect: a verdict the diagnosis does not name itself: after it reaches one of
            `refines` (``ANY``: whichever it reaches), ``detect(diagnosis)`` says whether this verdict
            applies instead (the first in ``ORDER`` that does, wins).
        sdpa_check: an SDPA culprit with this verdict is re-run under the other attention
            backends, and becomes ``kernel_specific`` when one of them is finite.
        precision_advice: the dtype is what to change: for a run without autocast (low-precision
            parameters, FSDP's param_dtype) the autocast advice is rewritten in its terms.
        without_culprit: its fixes are tried though no op is blamed (the FP8 verdicts: a probe's evidence
            names the cast, and the step is finite).
        amend: a refining verdict that blames another op than the one it refines (none, for
            ``healthy``): ``amend(diagnosis)`` gives the ``Diagnosis`` fields it replaces (``culprit``,
            ``trace``, ``context_ops``; ``evidence``, where the evidence about the op it no longer
            blames goes), read from the evidence its ``detect`` rests on.
    """

    name: str
    meaning: str
    summary: Callable[[Diagnosis], str]
    advice: Callable[[Diagnosis], list[AdviceLine]]
    fixes: tuple[str, ...] = ()
    refines: tuple[str, ...] = ()
    detect: Callable[[Diagnosis], bool] | None = None
    sdpa_check: bool = False
    precision_advice: bool = False
    without_culprit: bool = False
    amend: Callable[[Diagnosis], dict] | None = None

    def __post_init__(self):
        if bool(self.refines) != (self.detect is not None):
            raise ValueError(f"verdict {self.name!r}: refines and detect go together")


VERDICTS: dict[str, Verdict] = {}
# The order of ``VERDICTS``, whatever order their modules are imported in: ``refine`` tries the
# verdicts that refine another in this order (the first that detects itself wins). A verdict not
# listed here comes after these, in the order registered.
# instability before the FP8 and precision verdicts: a spike FP32 makes too is never blamed on a precision.
# compile_specific first: it refines whatever the eager runs reach (the compiled step is what training ran).
# fp8_nonfinite before not_reproduced: a NaN that only the FP8 replay makes is reproduced (by FP8).
ORDER = ("healthy", "compile_specific", "fp8_nonfinite", "not_reproduced", "nonfinite_input", "numerical_bug", "overflow",
         "underflow", "unregistered_op", "loss_scale_overflow", "kernel_specific", "cancellation", "instability",
         "fp8_underflow", "fp8_saturation", "precision_error")
ANY = "*"  # ``Verdict.refines``: whichever verdict the diagnosis reached

# Fixes that change the precision, and the precision each one switches to: a line recommending one
# is kept only when that precision's replay was finite (``respect_runs``).
PRECISION_FIXES = {"bf16": "bfloat16", "fp32": "float32"}
_GUARDS = frozenset({"guard_clamp", "guard_eps"})  # an edit at the culprit's own source line


def register(verdict: Verdict) -> Verdict:
    """Add `verdict` to ``VERDICTS``, in its place in ``ORDER`` (a name already there is refused)."""
    if verdict.name in VERDICTS:
        raise ValueError(f"verdict {verdict.name!r} is already registered")
    VERDICTS[verdict.name] = verdict
    in_order(VERDICTS, ORDER)
    return verdict


def in_order(registry: dict, order: tuple[str, ...]) -> None:
    """Sort `registry` in place: the names in `order` first, in that order, then the others as registered."""
    items = sorted(registry.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
    registry.clear()
    registry.update(items)


def refine(d: Diagnosis) -> Diagnosis:
    """`d` with the first registered verdict that refines its verdict and detects itself in it."""
    for v in VERDICTS.values():
        if (d.verdict in v.refines or ANY in v.refines) and v.detect(d):
            return dataclasses.replace(d, verdict=v.name, **(v.amend(d) if v.amend is not None else {}))
    return d


def summary(d: Diagnosis) -> str:
    """The one-sentence summary of `d`'s verdict, then the notes of the evidence (``Diagnosis.evidence``:
    what is wrong with the batch, the micro-batch, ...)."""
    text = VERDICTS[d.verdict].summary(d)
    h, c = d.hidden, d.culprit
    if hidden_first(c):
        # the first event in time heads the sentence: the forward op, then the backward symptom
        src = f" at {h['source']}" if h.get("source") else ""
        text = (f"First, {h['op']} in `{h['module']}` (forward, {h['precision']}){src} made {h['output_kind']} "
                f"from inputs up to {_fmt(h['input_absmax'])}, and a later forward op hid it (the loss stayed "
                f"finite); then, in backward, {text}")
    return text + _notes(d.evidence)


def _notes(evidence: Mapping) -> str:
    """The notes of the evidence, each after a space, in the order the probes ran (``probes.registry.ORDER``)."""
    out = ""
    for ev in evidence.values():
        note = getattr(ev, "note", None)
        text = note() if note is not None else None
        out += f" {text}" if text else ""
    return out


def advice(d: Diagnosis) -> list[AdviceLine]:
    """The verdict's advice lines, in the terms of the run's precision mode.

    ``d.tried`` (precision -> whether its replay was finite) keeps a line that recommends a
    precision only when that precision's replay was finite: it is dropped when that replay
    failed, and marked "(untested)" when there was none. ``d.scaler``, ``d.mode`` and ``d.low``
    keep the advice to tools the run uses: ``scaler.unscale_`` only for a run with a GradScaler,
    "add a GradScaler" only where one would work (FP16 autocast or FSDP, not FP16 parameters,
    whose gradients ``unscale_`` refuses), "switch to BF16" not for a run already in BF16.
    """
    v = VERDICTS[d.verdict]
    fault = [AdviceLine(BATCH_FAULT_ADVICE)] if "batch_fault" in d.evidence else []  # probes/batch_fault.py
    own = [a for a in v.advice(d) if a.text]
    if d.culprit is not None and installed_line(d.culprit.get("source")):  # no guard inside a library
        own = [a for a in own if not a.fixes or not set(a.fixes) <= _GUARDS]
    lines = respect_runs(fault + own, d.tried)
    return _mode_advice(d, lines) if v.precision_advice else lines


def respect_runs(lines: list[AdviceLine], tried: Mapping[str, bool] | None) -> list[AdviceLine]:
    """Drop a line recommending a precision whose replay failed; mark it untested without one."""
    if tried is None:
        return lines
    out = []
    for line in lines:
        precs = [PRECISION_FIXES[f] for f in line.fixes if f in PRECISION_FIXES]
        if not precs or all(tried.get(p) for p in precs):
            out.append(line)
        elif not any(p in tried for p in precs):
            out.append(AdviceLine(f"{line.text} (untested)", line.fixes))
    return out


# -- wording helpers -------------------------------------------------------------------------------
def _where(c) -> str:
    src = f" at {c['source']}" if c.get("source") else ""
    node = f", {c['node']}" if c.get("node") else ""
    return f"{c['op']} in `{c['module']}` ({c['phase']}{node}, {c['precision']}){src}"


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _finfo(precision: str):
    return torch.finfo(getattr(torch, precision))


def _outside_module(module: str) -> bool:
    """``<loss_fn>``, ``<autograd>``, ``<accumulate_grad>``: places outside any module of the model."""
    return module.startswith("<")


def loss_feeds_model(trace) -> str | None:
    """The first op of the loss function that computes a value the model's forward reads (``op at source``),
    or None when the model runs on the batch as given (only moves, casts and views before it).

    Then "compute the loss in FP32" would run the model in FP32 too: the loss function is not separable."""
    if trace is None:
        return None
    recs = trace.records
    for rec in recs:
        if rec.phase != "forward" or _outside_module(rec.module):
            continue
        todo, seen = [p for _s, p in rec.inputs if p is not None], set()
        while todo and len(seen) < 200:
            p = todo.pop()
            if p in seen or p >= len(recs):
                continue
            seen.add(p)
            r = recs[p]
            if r.module != "<loss_fn>":
                continue
            if r.name not in _THROUGH:  # views and casts move data; anything else computes it
                return f"{r.name} at {r.source}" if r.source else r.name
            todo.extend(q for _s, q in r.inputs if q is not None)
    return None


def from_model(d: Diagnosis) -> bool:
    """Whether the value the verdict is about derives from the weights, so that training can have grown it and
    learning-rate, weight-decay or activation-growth advice applies. Every verdict giving such advice asks here.

    - ``nonfinite_input``: a parameter, buffer or optimizer state was NaN/Inf before the step (an earlier
      update broke it), not only batch entries;
    - a culprit that raised on a constant beyond the dtype's range (``raised`` values): no, the constant is
      the value;
    - otherwise: the culprit or an op upstream of it read an ``nn.Parameter``; in a trace where no op read one
      (weights held as plain tensors), an op upstream of it ran in a module of the model.

    A value computed from the batch or a random draw alone is not. Unknown (no trace): True.
    """
    if d.verdict == "nonfinite_input":
        return any(i.partition(":")[0] in ("param", "buffer", "state") for i in d.nonfinite_inputs)
    t, c = d.trace, d.culprit
    if t is None or c is None or not isinstance(c.get("index"), int) or c["index"] >= len(t.records):
        return True
    if (c.get("raised") or {}).get("values"):
        return False
    up = _ancestors(t, c["index"])
    if any(r.reads_param for r in t.records):
        return any(t.records[p].reads_param for p in up | {c["index"]})
    return any(not _outside_module(t.records[p].module) for p in up)


def _keep_fp32(module: str, d: Diagnosis | None = None) -> AdviceLine:
    """Keep the culprit's module in FP32; for the loss function, compute the loss in FP32 (unless the loss
    function's own ops feed the model, which that would run in FP32 too); nothing for the other places
    outside any module, which no autocast region covers."""
    if module == "<loss_fn>":
        feeds = loss_feeds_model(d.trace) if d is not None else None
        if feeds is not None:
            return AdviceLine(f"Computing the loss in FP32 would run the whole model in FP32 here: the loss function "
                              f"computes the model's input itself ({feeds}); keep only the culprit's region in FP32.",
                              checked=True)
        return AdviceLine("Compute the loss in FP32: call the loss function on .float() inputs inside "
                          "torch.autocast(device_type, enabled=False), nested in the training step's autocast block.")
    if _outside_module(module):
        return AdviceLine("")
    return AdviceLine(f"Keep `{module}` in FP32: run it under torch.autocast(device_type, enabled=False) "
                      "with its inputs cast by .float().", ("module_fp32",))


def _noted(core: Callable[[Diagnosis], str]) -> Callable[[Diagnosis], str]:
    """`core`'s summary, with a note on NaN/Inf buffers the step only writes."""
    def text(d: Diagnosis) -> str:
        out = core(d)
        if d.written_only:
            more = f" (and {len(d.written_only) - 1} more)" if len(d.written_only) > 1 else ""
            out += (f" NB: {d.written_only[0]}{more} is NaN/Inf in the snapshot, but this step only writes it "
                    "(a train-mode BatchNorm's running stats, saved after the forward): not a cause.")
        return out
    return text


# -- a run without autocast ------------------------------------------------------------------------
# Advice written for autocast: keep a module in FP32 under autocast(enabled=False), switch to BF16 autocast.
_AUTOCAST_FIXES = frozenset({"module_fp32", "bf16"})


def _mode_advice(d: Diagnosis, lines: list[AdviceLine]) -> list[AdviceLine]:
    """The advice, rewritten where the run had no autocast to switch or turn off.

    The autocast advice does not apply to a model whose parameters are low precision: there, a
    module is kept in FP32 by its parameters' dtype, and the lasting fix is FP32 master weights.
    """
    c = d.culprit
    if d.mode == "autocast" or c is None or c.get("precision") == "float32":
        return lines  # the dtype is not what to change
    module, low = c.get("module", "?"), d.low
    out = [a for a in lines if not _AUTOCAST_FIXES & set(a.fixes)]
    if d.mode == "parameters":
        out.insert(0, AdviceLine(
            f"The parameters themselves are {low} and no autocast ran, so every op computes in "
            f"{low}. Keep FP32 master weights: build the model in FP32 and train under "
            f"torch.autocast(device_type, dtype=torch.{low})"
            + (" with a torch.amp.GradScaler." if low == "float16" else ".")))
        if not _outside_module(module):  # <loss_fn>, <autograd>: no module to call .float() on
            out.append(AdviceLine(f"Or keep `{module}` in FP32: `{module}`.float(), with its input cast by .float() "
                                  f"and its output cast back with .to(torch.{low})."))
        if low == "float16" and d.verdict == "overflow":
            out.append(AdviceLine("Or train in bfloat16 (model.to(torch.bfloat16)): it has FP32's range, so this "
                                  "value fits.", ("bf16",)))
    else:
        out.insert(0, AdviceLine(
            f"FSDP computes in param_dtype={low}: keep `{module}` in FP32, either inside its "
            f"forward (compute on x.float() and cast the result back with .to(x.dtype)) or by sharding it "
            "with its own policy before the root's fully_shard, fully_shard(module, "
            "mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch."
            f"{low})), which casts its inputs to FP32 and its outputs back."))
        if low == "float16" and d.verdict == "overflow":
            out.append(AdviceLine("Or use MixedPrecisionPolicy(param_dtype=torch.bfloat16): it has FP32's range.",
                                  ("bf16",)))
    return out

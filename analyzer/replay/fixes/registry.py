"""The fix registry, and the fixes tried on the snapshot: re-run the failing step with each fix.

Each fix is one ``FixSpec`` in ``FIXES`` (``register_fix``): its name, title, how to apply it to
the rebuilt model, the verdicts it serves and the advice it stands for once verified. A replay's
``try_fixes`` re-runs the culprit's step (its precision, its loss scale) once per fix that serves
the verdict (``plan``), under the same op recorder:

- ``guard_clamp`` / ``guard_eps``: the input of the culprit's log, div, sqrt, rsqrt, acos or pow
  clamped away from the singular point, or moved by the dtype's eps;
- ``module_fp32``: the culprit's module with autocast off inside it and its inputs upcast;
- ``op_fp32``: the culprit op alone computed in FP32, its result cast back;
- ``bf16`` (from FP16) / ``fp32`` (from BF16): the other precision (a run replay already made
  is reused, not repeated);
- ``lower_scale``: the largest power-of-two loss scale whose backward is finite, computed from
  the per-op maxima replay already has and verified with one run;
- ``check_input`` (verdict ``nonfinite_input``): nothing to run; which input to look at;
- ``reduce_fp32`` (a culprit born in a collective, the distributed replay's): the gradients reduced in FP32.

Each fix says which kinds of culprit it can act on (``FixSpec.acts_on``): an op of the model, or a
collective. The distributed replay calls ``run_fixes`` for both, so a reduction that overflowed gets
the fixes that act on a collective and never those that hook a module or an op of the model.

Each ``Fix`` is ``verified`` (every gradient finite and the loss within ``_reference.TOLERANCE`` of
the FP32 run's; with no finite FP32 run, finite and plausible), ``changes_result`` (finite, but
far from that reference: never recommended), ``fails`` (still non-finite; the first bad op is
named) or ``not_tried`` (with the reason). ``advice_with_status`` turns the verdict's advice and
the fixes into ``Advice`` items that never recommend a fix that was not verified.

NB: replays run forward and backward only. A fix verified here makes the step's loss match the
reference and its gradients finite; the optimizer step that follows is not replayed.

Example:
    >>> from analyzer.replay import Replay, advice_with_status
    >>> replay = Replay(path)                                      # doctest: +SKIP
    >>> r = replay.run()                                           # doctest: +SKIP
    >>> [(f.name, f.status) for f in replay.try_fixes(r)]          # doctest: +SKIP
    [('module_fp32', 'verified'), ('op_fp32', 'fails'), ('bf16', 'verified')]
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

import torch

from ...errors import AnalyzerError
from ...findings import json_safe
from ._hooks import ModuleNotFound
from ..detection._origin import find_origin
from ._reference import judge
from ..runs._runs import ReplayContext, run_once
from ..result.trace import RunTrace
from ..result.replay_result import ReplayResult
from ..verdicts.registry import ORDER as VERDICT_ORDER
from ..verdicts.registry import VERDICTS, in_order

__all__ = ["FIX_STATUSES", "CULPRIT_KINDS", "Fix", "Advice", "FixSpec", "FIXES", "ORDER", "register_fix", "culprit_kind",
           "plan", "run_fixes"]

FIX_STATUSES = ("verified", "fails", "not_tried", "changes_result")
ADVICE_STATUSES = ("verified", "untested", "checked")
# What a culprit is, for the fixes that can act on it: an op of the model (its module, its inputs, its precision)
# or a collective (the distributed replay's reduce-scatter or all-reduce of the gradients, ``culprit_kind``).
CULPRIT_KINDS = ("op", "collective")

_NO_MODULE = ("<loss_fn>", "<loss_scale>", "<autograd>", "<accumulate_grad>")
_NAMES = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32"}


@dataclass(frozen=True)
class Fix:
    """One fix tried on the failing step, and what happened.

    Attributes:
        name: stable id: ``module_fp32``, ``op_fp32``, ``bf16``, ``fp32``, ``lower_scale``,
            ``guard_clamp``, ``guard_eps`` or ``check_input``.
        title: one human line saying what the fix is.
        status: one of ``FIX_STATUSES``.
        detail: what happened, or why it was not tried.
        precision: the precision the fix was run in.
        failing_op: where it is still non-finite (status ``fails``).
        max_safe_scale: ``lower_scale`` and ``region_fp32`` only: the power-of-two loss scale the fixed step was
            found finite at (``region_fp32``: the one GradScaler backs off to).
        loss / reference_loss: a finite fixed step's loss, and the loss it was judged against
            (``_reference``: the FP32 run's, or the last finite recorded one; None: no reference).
        covers: ``module_fp32`` only: the other modules of the culprit's class it also kept in FP32
            (not in the JSON; the title names them).
    """

    name: str
    title: str
    status: str
    detail: str
    precision: str | None = None
    failing_op: str | None = None
    max_safe_scale: float | None = None
    loss: float | None = None
    reference_loss: float | None = None
    covers: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self):
        if self.status not in FIX_STATUSES:
            raise ValueError(f"status must be one of {FIX_STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["covers"]
        return json_safe(out)


@dataclass(frozen=True)
class Advice:
    """One thing to try. A fix that failed on the snapshot is never one.

    Attributes:
        text: the advice, one paragraph.
        status: ``verified`` (a fix tried on the snapshot made the step come out as FP32 computes it),
            ``untested``, or ``checked`` (not advice to try: what the replay's values show, such as why
            a remedy is not offered, ``AdviceLine.checked``).
        fix: the ``Fix.name`` it rests on, when it is one.
    """

    text: str
    status: str
    fix: str | None = None

    def __post_init__(self):
        if self.status not in ADVICE_STATUSES:
            raise ValueError(f"status must be one of {ADVICE_STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict:
        return json_safe(asdict(self))


@dataclass(frozen=True)
class FixSpec:
    """One fix replay can try on the rebuilt model, found by name in ``FIXES``.

    Attributes:
        name: the stable id (``Fix.name``, an advice line's ``fixes``).
        title: what the fix is, in a few words.
        apply: ``apply(ctx, result)`` re-runs the step with the fix on the rebuilt model
            (``ctx``, a ``ReplayContext``) and judges it; None when it does not apply to this culprit.
        serves: the verdicts it is tried for (after the fixes a verdict names itself, ``Verdict.fixes``).
        line: ``line(fix, culprit, mode)``: the advice a verified fix stands for, in the terms of the
            run's precision mode (``autocast``, ``parameters``, ``fsdp_param_dtype``).
        applies: ``applies(verdict, culprit)``: whether to plan it for this culprit at all.
        needs_model: whether ``apply`` runs the step (False: it only names what to look at).
        acts_on: the kinds of culprit (``CULPRIT_KINDS``, ``culprit_kind``) it can act on: ``op``, an op of the
            model (every fix that hooks a module, an op or the precision), or ``collective``, a reduction of the
            gradients across ranks (``reduce_fp32``); a fix is never planned for a culprit of another kind.
    """

    name: str
    title: str
    apply: Callable[[ReplayContext | None, ReplayResult], Fix | None]
    serves: tuple[str, ...]
    line: Callable[[Fix, Mapping, str], str] = lambda fix, _c, _mode: fix.title
    applies: Callable[[str, Mapping], bool] = lambda _v, _c: True
    needs_model: bool = True
    acts_on: tuple[str, ...] = ("op",)

    def __post_init__(self):
        unknown = [k for k in self.acts_on if k not in CULPRIT_KINDS]
        if not self.acts_on or unknown:
            raise ValueError(f"acts_on must be a non-empty tuple of {CULPRIT_KINDS}, got {self.acts_on!r}")


FIXES: dict[str, FixSpec] = {}
# The order fixes are tried in (after those a verdict names itself, ``Verdict.fixes``), whatever order
# their modules are imported in; a fix not listed here comes after these, in the order registered.
ORDER = ("guard_clamp", "guard_eps", "region_fp32", "born_fp32", "module_fp32", "op_fp32", "bf16", "fp32", "lower_scale",
         "reduce_fp32", "check_input", "scaler_skip", "compile_disable", "fp8_rowwise", "fp8_keep_bf16", "fp8_e5m2_grads",
         "fp8_smooth_swiglu", "fp8_mxfp8")


def register_fix(spec: FixSpec) -> FixSpec:
    """Add `spec` to ``FIXES``, in its place in ``ORDER`` (a name already there is refused).

    The verdicts it ``serves`` must be registered or listed in ``verdicts.ORDER`` (a built-in verdict
    may be registered after the fixes that serve it, whatever the import order).
    """
    if spec.name in FIXES:
        raise ValueError(f"fix {spec.name!r} is already registered")
    unknown = [v for v in spec.serves if v not in VERDICTS and v not in VERDICT_ORDER]
    if unknown:
        raise ValueError(f"fix {spec.name!r} serves unknown verdicts {unknown}")
    FIXES[spec.name] = spec
    in_order(FIXES, ORDER)
    return spec


def culprit_kind(culprit: Mapping | None) -> str:
    """``collective`` for a culprit born in a collective (the distributed replay's culprit with its
    ``collective`` entry: every rank's input and the reduced value), else ``op`` (no culprit included)."""
    return "collective" if isinstance(culprit, Mapping) and "collective" in culprit else "op"


def plan(result: ReplayResult) -> list[FixSpec]:
    """The fixes to try for `result`: those its verdict names (``Verdict.fixes``), then the others
    that serve it, each only where it acts on the culprit's kind (``FixSpec.acts_on``) and ``applies``
    to the culprit."""
    v, c = result.verdict, result.culprit
    kind = culprit_kind(c)
    named = [FIXES[name] for name in VERDICTS[v].fixes]
    candidates = named + [f for f in FIXES.values() if v in f.serves and f not in named]
    return [f for f in candidates if kind in f.acts_on and f.applies(v, c)]


def run_fixes(result: ReplayResult, context: Callable[[], ReplayContext]) -> list[Fix]:
    """Try each fix that applies to `result`'s verdict on the step, one run each at most.

    `context` gives the rebuilt model the fixes run on (called only when a fix needs it).

    Returns:
        The fixes in the order tried; empty for a healthy step.
    """
    blameless = VERDICTS[result.verdict].without_culprit if result.verdict in VERDICTS else False
    if result.culprit is None and not blameless:
        return [] if result.verdict in ("healthy", "not_reproduced", "compile_specific", "instability",
                                        "precision_error") else [_check_input(result)]
    specs = plan(result)
    if not any(s.needs_model for s in specs):
        return [fix for s in specs if (fix := s.apply(None, result)) is not None]
    if result.culprit is not None and result.culprit["phase"] not in ("forward", "backward"):  # e.g. an optimizer update (replay/update.py)
        op, where = result.culprit["op"], result.culprit["module"]
        return [Fix(name="check_input", status="not_tried",
                    title=f"change the optimizer's settings as the advice says: {op} in {where} made the NaN/Inf",
                    detail="replay recomputes the update from the saved state; it cannot re-run the optimizer "
                           "with other settings, and no fix of the forward or backward applies")]
    ctx = context()
    fork = [ctx.device.index or 0] if ctx.device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork):  # the caller's RNG is left as it was
        return [fix for s in specs if (fix := s.apply(ctx, result)) is not None]


def _check_input(result: ReplayResult, why: str | None = None) -> Fix:
    names = list(result.nonfinite_inputs)
    first = names[0] if names else "an input"
    kind, _, name = first.partition(":")
    what = {"param": "parameter", "buffer": "buffer", "batch": "batch entry", "state": "state entry"}.get(kind, "input")
    more = f" (and {len(names) - 1} more: {', '.join(names[1:4])})" if len(names) > 1 else ""
    where = ("an earlier step broke the weights: replay the run's earliest snapshot"
             if kind in ("param", "buffer", "state") else "check the data pipeline that built this batch")
    return Fix(name="check_input", title=f"look at the {what} {name or first}{more}, NaN/Inf before the step ran",
               status="not_tried",
               detail=why or f"no fix can be tried on a step whose input is already non-finite; {where}")


# -- running one fix -------------------------------------------------------------------------------
def _where(trace: RunTrace) -> str | None:
    o = find_origin(trace)
    if o is None or o.index is None:
        return None
    rec = trace.records[o.index]
    return f"{rec.name} in {rec.module} ({rec.phase})"


def _judge(result: ReplayResult, name: str, title: str, trace: RunTrace, *, note: str = "",
           reference: RunTrace | None = None, judgement=None, **extra) -> Fix:
    """`trace`, a fix's run, judged (``_reference.judge``; against `reference`, the FP32 run with its gradients,
    where given), or by a `judgement` already made of it."""
    prec = trace.precision
    at = f" at loss scale {trace.scale:g}" if trace.scale != 1.0 else ""
    if trace.finite:  # verified only when it matches the reference (_reference.judge)
        j = judgement if judgement is not None else judge(result, trace, reference)
        if j.status != "verified":
            extra.pop("max_safe_scale", None)
        return Fix(name=name, title=title, status=j.status, precision=prec, loss=j.loss,
                   reference_loss=j.reference_loss,
                   detail=f"{'the step' if result.step is None else f'step {result.step}'} runs finite in {prec}{at}: "
                          f"loss and every gradient{note}; {j.detail}", **extra)
    bad = _where(trace)
    why = "the loss" if not trace.forward_finite else "a gradient"
    skip = (" (GradScaler would skip the step and lower the scale)"
            if trace.forward_finite and trace.scale > 1.0 else "")
    return Fix(name=name, title=title, status="fails", precision=prec, failing_op=bad,
               detail=f"still non-finite{at}: {why}, first at {bad or 'an unrecorded op'}{skip}")


def _attempt(ctx: ReplayContext, result: ReplayResult, name: str, title: str, precision: str, scale: float,
             **kwargs) -> RunTrace | Fix:
    """One run of the step with a fix's hooks; a user-code error becomes a not_tried Fix."""
    try:
        return run_once(ctx, precision, scale, **kwargs)
    except ModuleNotFound as e:
        return Fix(name=name, title=title, status="not_tried", precision=precision,
                   detail=f"the rebuilt model has no module {e.args[0]!r}")
    except AnalyzerError as e:
        return Fix(name=name, title=title, status="not_tried", precision=precision,
                   detail=f"the step raised with this fix applied: {e.message}")


def _culprit_run(result: ReplayResult) -> tuple[str, float]:
    c = result.culprit
    t = result.culprit_trace
    return c["precision"], (t.scale if t is not None else result.scale)

"""The FP8 diagnosis of a step: replay it in FP32, in BF16 (no FP8) and in FP8, and name what broke.

The FP8 run is the recorded recipe applied to the rebuilt model (``recipe``), in the precision training
ran in (BF16 autocast, usually). Every cast it makes is counted (``casts``); its gradients and Linear
outputs are compared with BF16's and FP32's (``step``). The answer:

- ``first``: the first cast of the step, by module, operand role and pass, that flushes more than
  ``UNDERFLOW_LIMIT`` of its non-zero values or saturates more than ``SATURATE_LIMIT`` of its values
  (before the clamp). An all-zero operand flushes nothing (torchao 0.18 floors its amax at 1e-12).
- ``jump``: the first Linear, in the order the step called them, whose output is farther than
  ``step.OUT_REL_TOL`` from BF16's (median over tokens), with the Linear before it; ``grad_jump``: the
  first parameter, in the order backward reaches them (the model's order reversed), whose gradient is
  beyond ``step.GRAD_REL_TOL`` / ``step.GRAD_COS_TOL``.
- ``verdict``: ``fp8_underflow`` or ``fp8_saturation`` when such a cast exists *and* the FP8 step does not
  agree with BF16 (``step.agrees``); a cast that breaks while the step agrees is reported, not a verdict.
- ``nonfinite_at``: an FP8-born NaN/Inf (FP32 and BF16 finite), localised to its first op as any NaN is, with
  ``cast``: the last FP8 cast before that op in its pass that flushed values (else one that saturated), where
  the value went wrong (verdict ``fp8_nonfinite``).

Real output (``replay --json``'s ``fp8.first`` of the aligned SwiGLU in ``tests/analyzer/replay/fp8/``)::

    {"module": "block.mlp.w2", "phase": "forward", "role": "input", "use": "forward", "fmt": "e4m3",
     "granularity": "tensorwise", "outlier": {"row": 3, "column": 5}, "flushed_frac": 0.979, ...}
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from ..detection._origin import find_origin
from ..runs._runs import ReplayContext
from .casts import Fp8Cast
from .recipe import is_mxfp8
from .step import (GRAD_COS_TOL, GRAD_REL_TOL, OUT_REL_TOL, Agreement, StepValues, agreement, agrees, fp8_context,
                   output_errors, run_values, worst)

__all__ = ["UNDERFLOW_LIMIT", "SATURATE_LIMIT", "Judgement", "Fp8Evidence", "fp8_diagnosis", "breaking", "judge_values"]

UNDERFLOW_LIMIT = 0.5  # "most of a tensor": more than half of its non-zero values flushed to exact zero
SATURATE_LIMIT = 1e-4  # one value in 10,000 beyond the format's max (a scale's own rounding is not counted)


def breaking(c: Fp8Cast) -> str | None:
    """``"saturation"``, ``"underflow"`` or None: what this cast breaks, by the documented limits."""
    if c.stats.saturated_frac > SATURATE_LIMIT:
        return "saturation"
    if c.stats.flushed_frac > UNDERFLOW_LIMIT:
        return "underflow"
    return None


@dataclasses.dataclass(frozen=True)
class Judgement:
    """One FP8 step against the BF16 reference: its gradients, its Linear outputs, and whether it agrees."""

    grads: tuple[Agreement, ...]
    outputs: Mapping[str, float]

    @property
    def agrees(self) -> bool:
        return agrees(list(self.grads), self.outputs)

    def worst_grad(self) -> Agreement | None:
        return worst(list(self.grads))

    def worst_output(self) -> tuple[str, float] | None:
        return max(self.outputs.items(), key=lambda kv: kv[1], default=None)

    def numbers(self) -> str:
        g, o = self.worst_grad(), self.worst_output()
        gtxt = f"worst gradient {g.name}: cosine {g.cosine:.4f}, relative error {g.rel_err:.3f}" if g else "no gradient"
        otxt = f"worst Linear output {o[0]}: {o[1]:.3f} off per token (median)" if o else "no Linear output"
        return f"{gtxt}; {otxt}"


def judge_values(v: StepValues, ref: StepValues) -> Judgement:
    """`v` against the reference run `ref` (BF16 without FP8)."""
    return Judgement(tuple(agreement(v.grads, ref.grads)), output_errors(v.outputs, ref.outputs))


@dataclasses.dataclass(frozen=True)
class Fp8Evidence:
    """What the FP8 replay found (module doc). ``reference`` (BF16's values) is kept for the fixes, not in the JSON."""

    roles: Mapping[str, Mapping]
    modules: tuple[str, ...]
    precision: str
    losses: Mapping[str, float]
    casts: tuple[Fp8Cast, ...]
    vs_bf16: Judgement
    vs_fp32: Judgement
    bf16_vs_fp32: Judgement
    nonfinite_at: Mapping | None
    reference: StepValues = dataclasses.field(repr=False, compare=False)
    mxfp8: bool = False  # every recorded module already trains in MXFP8 with RCEIL scales (recipe.is_mxfp8)

    @property
    def first(self) -> Fp8Cast | None:
        return next((c for c in self.casts if breaking(c)), None)

    @property
    def verdict(self) -> str | None:
        if self.nonfinite_at is not None:
            return "fp8_nonfinite"
        c = self.first
        if c is None or self.vs_bf16.agrees:
            return None
        return f"fp8_{breaking(c)}"

    @property
    def nonfinite_cast(self) -> Fp8Cast | None:
        """With an FP8-born NaN/Inf: the last cast before its op, in its pass, that flushed (else saturated) values."""
        n = self.nonfinite_at
        if n is None:
            return None
        before = [c for c in self.casts if c.index < n["index"] and c.phase == n["phase"]]
        return next((c for c in reversed(before) if c.stats.flushed), None) or next(
            (c for c in reversed(before) if c.stats.saturated), None)

    @property
    def jump(self) -> dict | None:
        prev = None
        for name, err in self.vs_bf16.outputs.items():
            if err > OUT_REL_TOL:
                return {"layer": name, "rel_err": _num(err),
                        "previous": None if prev is None else {"layer": prev[0], "rel_err": _num(prev[1])}}
            prev = (name, err)
        return None

    @property
    def grad_jump(self) -> dict | None:
        prev = None
        for r in reversed(self.vs_bf16.grads):
            if not r.agrees:
                return {**r.to_dict(), "previous": None if prev is None else prev.to_dict()}
            prev = r
        return None

    def to_dict(self) -> dict:
        first = self.first
        fp32 = {r.name: r for r in self.vs_fp32.grads}
        return {"fp8": {
            "verdict": self.verdict, "precision": self.precision, "roles": dict(self.roles),
            "modules": list(self.modules), "losses": {k: _num(v) for k, v in self.losses.items()},
            "thresholds": {"flushed_frac": UNDERFLOW_LIMIT, "saturated_frac": SATURATE_LIMIT,
                           "grad_cosine": GRAD_COS_TOL, "grad_rel_err": GRAD_REL_TOL, "output_rel_err": OUT_REL_TOL},
            "first": None if first is None else {**first.to_dict(), "breaks": breaking(first)},
            "breaking": [{**c.to_dict(), "breaks": breaking(c)} for c in self.casts if breaking(c)],
            "casts": len(self.casts),
            "agrees_with_bf16": self.vs_bf16.agrees, "bf16_agrees_with_fp32": self.bf16_vs_fp32.agrees,
            "gradients": [{"name": r.name, "cosine_bf16": _num(r.cosine), "rel_err_bf16": _num(r.rel_err),
                           "cosine_fp32": _num(fp32[r.name].cosine) if r.name in fp32 else None,
                           "rel_err_fp32": _num(fp32[r.name].rel_err) if r.name in fp32 else None}
                          for r in self.vs_bf16.grads],
            "outputs": [{"layer": n, "rel_err_bf16": _num(e), "rel_err_fp32": _num(self.vs_fp32.outputs.get(n, math.nan))}
                        for n, e in self.vs_bf16.outputs.items()],
            "jump": self.jump, "grad_jump": self.grad_jump,
            "nonfinite_at": None if self.nonfinite_at is None else {
                **self.nonfinite_at, "cast": None if self.nonfinite_cast is None else self.nonfinite_cast.to_dict()}}}

    def note(self) -> str:
        if self.verdict is not None:
            return ""  # the verdict's own summary says it
        c = self.first
        if c is not None:
            return (f"In FP8, {c.where} {_what(c)}, but the step agrees with BF16 within the tolerance "
                    f"({self.vs_bf16.numbers()}).")
        return ""


def _what(c: Fp8Cast) -> str:
    s = c.stats
    if breaking(c) == "saturation":
        return f"saturated {s.saturated} of {s.numel} values ({s.saturated_frac:.2%}) beyond {c.fmt}'s max"
    return f"flushed {s.flushed_frac:.1%} of its non-zero values to zero"


def _num(v: float) -> float | None:
    return v if math.isfinite(v) else None


def fp8_diagnosis(ctx: ReplayContext, precision: str) -> Fp8Evidence:
    """Replay the step in FP32, BF16 and FP8 (`precision` with the recorded recipe) and compare them."""
    recipe = ctx.fp8_recipe
    fp32 = run_values(ctx, "float32", "float32")
    bf16 = run_values(ctx, "bfloat16", "bfloat16")
    fp8 = run_values(fp8_context(ctx), precision, "fp8", fp8=True)
    nonfinite = None
    if not fp8.finite and fp32.finite and bf16.finite:
        o = find_origin(fp8.trace)
        if o is not None and o.index is not None:
            rec = fp8.trace.records[o.index]
            nonfinite = {"op": rec.name, "module": rec.module, "phase": rec.phase, "index": rec.index}
    roles = recipe["configs"][0].get("roles", {}) if recipe["configs"] else {}
    return Fp8Evidence(
        roles=roles, modules=tuple(recipe["modules"]), precision=precision,
        losses={"float32": fp32.trace.loss, "bfloat16": bf16.trace.loss, "fp8": fp8.trace.loss},
        casts=fp8.casts, vs_bf16=judge_values(fp8, bf16), vs_fp32=judge_values(fp8, fp32),
        bf16_vs_fp32=judge_values(bf16, fp32), nonfinite_at=nonfinite, reference=bf16, mxfp8=is_mxfp8(recipe))


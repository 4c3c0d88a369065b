"""FP8 readiness of a BF16 (or FP32) step: what FP8 training would flush or saturate, per Linear and operand.

The step is replayed once in the precision it trained in, and every ``nn.Linear``'s three GEMM operands
(``input``, ``weight``, ``grad_output``) are cast, in statistics only, as each FP8 recipe would cast them
(``recorders.fp8``): torchao's ``tensorwise`` (e4m3 input and weight, e5m2 grad_output) and ``rowwise``
(all e4m3, power-of-2 scales per row), and ``mxfp8`` (e4m3 in blocks of 32, RCEIL scales). Rowwise and
MX scales run along the axis each GEMM reduces over, and each operand serves two GEMMs (input: the
forward and the weight gradient; weight: the forward and the input gradient; grad_output: both
gradients), so both axes are cast and the worse one is kept. Nothing is trained, nothing needs torchao.

A cast *breaks* when more than ``FLUSH_LIMIT`` of its non-zero values flush to zero, or more than
``SATURATE_LIMIT`` of its values pass the format's max. A Linear that breaks under a recipe is printed in
the ``module_filter_fn`` that keeps it in BF16 under that recipe.

Real output (a SwiGLU block whose w1/w3 rows align on one rare token, ``tests/analyzer/replay/fp8/``:
w2's input amax is 2e4 against a median of 0.005; one tensorwise scale flushes most of it, rowwise scales
lose only the rows of that token, 2 of 64)::

    block.mlp.w2  input  amax 1.98e+04  amax/median 4.06e+06  tensorwise: BREAKS 97.8% flushed (forward)
                                                            rowwise: 3.1% flushed  mxfp8: 1.5% flushed
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from torch.utils._python_dispatch import _disable_current_modes

from recorders.fp8 import CastStats, cast_counts

from ..runs._runs import ReplayContext, run_once

__all__ = ["FLUSH_LIMIT", "SATURATE_LIMIT", "RECIPES", "OperandStats", "Readiness", "fp8_readiness"]

FLUSH_LIMIT = 0.05  # a cast that zeroes 5% of its non-zero values has lost a part of the tensor
SATURATE_LIMIT = 1e-4  # one value in 10,000 clipped at the format's max: the largest values are the ones that matter
ROLES = ("input", "weight", "grad_output")
# recipe -> role -> format (torchao 0.18: Float8LinearConfig.from_recipe_name, MXFP8 training recipes)
RECIPES = {
    "tensorwise": {"input": "e4m3", "weight": "e4m3", "grad_output": "e5m2"},
    "rowwise": {"input": "e4m3", "weight": "e4m3", "grad_output": "e4m3"},
    "mxfp8": {"input": "e4m3", "weight": "e4m3", "grad_output": "e4m3"},
}
# role -> [(use, the axis its GEMM reduces over, for a 2-D operand)]
_USES = {
    "input": [("forward", -1), ("weight gradient", 0)],
    "weight": [("forward", -1), ("input gradient", 0)],
    "grad_output": [("input gradient", -1), ("weight gradient", 0)],
}


@dataclasses.dataclass(frozen=True)
class OperandStats:
    """One Linear operand: its range and, per recipe, its worst cast.

    Attributes:
        module, role: the Linear's qualified name and ``input``, ``weight`` or ``grad_output``.
        amax: the largest |x|; median: the median |x| of its non-zero values (0 when none).
        casts: recipe -> (the use whose cast loses most, its ``CastStats``).
    """

    module: str
    role: str
    amax: float
    median: float
    casts: dict[str, tuple[str, CastStats]]

    @property
    def dynamic_range(self) -> float:
        return self.amax / self.median if self.median > 0 else math.inf if self.amax > 0 else 0.0

    def breaks(self, recipe: str) -> bool:
        s = self.casts[recipe][1]
        return s.flushed_frac > FLUSH_LIMIT or s.saturated_frac > SATURATE_LIMIT

    def to_dict(self) -> dict:
        return {"module": self.module, "role": self.role, "amax": self.amax, "median_abs": self.median,
                "dynamic_range": self.dynamic_range if math.isfinite(self.dynamic_range) else None,
                "recipes": {r: {"use": use, "breaks": self.breaks(r), **s.to_dict()}
                            for r, (use, s) in self.casts.items()}}


@dataclasses.dataclass(frozen=True)
class Readiness:
    """The FP8 readiness of one step: every Linear operand, and the Linears that break per recipe."""

    precision: str
    operands: tuple[OperandStats, ...]
    loss: float

    def breaking(self, recipe: str) -> list[OperandStats]:
        return [o for o in self.operands if o.breaks(recipe)]

    def keep_high(self, recipe: str) -> list[str]:
        """The Linears to keep out of FP8 under `recipe`, in model order."""
        return list(dict.fromkeys(o.module for o in self.breaking(recipe)))

    def module_filter_fn(self, recipe: str) -> str:
        """Source of a torchao ``module_filter_fn`` that keeps `recipe`'s breaking Linears in high precision."""
        keep = self.keep_high(recipe)
        names = "{" + ", ".join(repr(k) for k in keep) + "}" if keep else "set()"
        return ("def module_filter_fn(mod, fqn):\n"
                f"    # keep in {self.precision}: the Linears whose FP8 casts break under {recipe} scaling\n"
                f"    return fqn not in {names}")

    def to_dict(self) -> dict:
        return {"precision": self.precision, "loss": self.loss if math.isfinite(self.loss) else None,
                "thresholds": {"flushed_frac": FLUSH_LIMIT, "saturated_frac": SATURATE_LIMIT},
                "operands": [o.to_dict() for o in self.operands],
                "keep_high": {r: self.keep_high(r) for r in RECIPES},
                "module_filter_fn": {r: self.module_filter_fn(r) for r in RECIPES}}


class _Collect:
    """Forward hooks on every Linear that queue each operand's cast counts, on device (no sync)."""

    def __init__(self, model: torch.nn.Module):
        self.linears = {m: n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.counts: list[tuple[str, str, torch.Tensor]] = []  # (module, role, stacked counts)

    def _add(self, name: str, role: str, x: torch.Tensor) -> None:
        # the statistics are not the step's ops: out of the replay's dispatch mode and of autocast
        with _disable_current_modes(), torch.autocast(x.device.type, enabled=False):
            self._queue(name, role, x)

    def _queue(self, name: str, role: str, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]) if x.dim() != 2 else x.detach()
        absx = x.abs().float().flatten()
        nz = absx[absx > 0]
        median = nz.median() if nz.numel() else torch.zeros((), device=x.device)
        rows = [torch.stack([absx.amax() if absx.numel() else median, median]).double()]
        for recipe, fmts in RECIPES.items():
            for _use, dim in _USES[role]:
                rows.append(cast_counts(x, fmts[role], recipe, dim=dim))
        self.counts.append((name, role, torch.cat(rows)))

    @contextlib.contextmanager
    def __call__(self, model: torch.nn.Module):
        def pre(mod, args):
            if not args or not isinstance(args[0], torch.Tensor):
                return
            dtype = torch.get_autocast_dtype(args[0].device.type) if torch.is_autocast_enabled(
                args[0].device.type) else None
            x, w = args[0], mod.weight
            self._add(self.linears[mod], "input", x.to(dtype) if dtype is not None else x)
            self._add(self.linears[mod], "weight", w.to(dtype) if dtype is not None else w)

        def post(mod, _args, out):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                name = self.linears[mod]
                out.register_hook(lambda g: self._add(name, "grad_output", g))

        handles = [h for m in self.linears for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
        try:
            yield model
        finally:
            for h in handles:
                h.remove()


def fp8_readiness(ctx: ReplayContext) -> Readiness:
    """Replay the step once in its own precision and cast every Linear operand as each FP8 recipe would.

    Args:
        ctx: a rebuilt replay context (``Replay(path).context()``).

    Returns:
        A ``Readiness``; its operands are in the order the step first touched them (forward, then backward).
    """
    precision = ctx.mode.dtype or "float32"
    collect = _Collect(ctx.build_model(precision))
    trace = run_once(ctx, precision, 1.0, prepare=collect)
    if not collect.linears:
        return Readiness(precision, (), trace.loss)
    values = torch.stack([c for _, _, c in collect.counts]).tolist() if collect.counts else []  # NB: one sync
    per_recipe = len(_USES["input"]) * 8
    merged: dict[tuple[str, str], OperandStats] = {}
    for (name, role, _), v in zip(collect.counts, values):
        casts = {}
        for i, recipe in enumerate(RECIPES):
            worst = None
            for j, (use, _dim) in enumerate(_USES[role]):
                c = v[2 + i * per_recipe + j * 8: 2 + i * per_recipe + (j + 1) * 8]
                s = CastStats.from_counts(RECIPES[recipe][role], recipe, c)
                if worst is None or _loss_of(s) > _loss_of(worst[1]):
                    worst = (use, s)
            casts[recipe] = worst
        op = OperandStats(name, role, v[0], v[1], casts)
        key = (name, role)
        # a Linear called more than once in the step (shared weights, micro-batches): keep its worst call
        if key not in merged or _worst_over(op) > _worst_over(merged[key]):
            merged[key] = op
    return Readiness(precision, tuple(merged.values()), trace.loss)


def _loss_of(s: CastStats) -> float:
    """How much a cast loses, for ranking: the larger of its flushed and saturated fractions, each against its limit."""
    return max(s.flushed_frac / FLUSH_LIMIT, s.saturated_frac / SATURATE_LIMIT)


def _worst_over(op: OperandStats) -> float:
    return max(_loss_of(s) for _, s in op.casts.values())

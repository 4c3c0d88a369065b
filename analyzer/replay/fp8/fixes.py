"""The FP8 fixes, verified on the step: each re-runs the FP8 step changed one way and judges it against BF16.

A fix is ``verified`` when the changed FP8 step agrees with the BF16 run (no FP8) within the documented
tolerance (``step.agrees``: every gradient's cosine and relative error, every Linear's per-token output
error), where the unchanged FP8 step did not; its detail gives both steps' numbers. ``fails``: it still
does not agree; ``not_tried``: torchao could not run it here (the reason is given).

- ``fp8_rowwise``: torchao's ``rowwise`` recipe for the recorded modules (e4m3, a power-of-2 scale per row);
- ``fp8_keep_bf16``: the modules whose casts broke left out of FP8 (the ``module_filter_fn`` is printed);
- ``fp8_e5m2_grads``: the recorded recipe with gradients cast to e5m2, where the broken cast is an e4m3
  grad_output of a float8 recipe (saturated beyond e4m3's 448, or flushed below its smallest subnormal);
- ``fp8_smooth_swiglu``: where the broken cast is a Linear's input whose largest channel amax is at least
  ``verdicts.CHANNEL_GAP`` (10) times every other channel's (the aligned-channel pattern), a per-channel scale ``s`` on
  that input, ``x / s``, and its weight's columns times ``s`` (exact in high precision); ``s = sqrt(amax_x / amax_w)`` per input channel, which
  gives the input and the weight the same range (SmoothQuant's alpha = 0.5);
- ``fp8_mxfp8``: torchao's emulated MXFP8 training (``MXFP8TrainingOpConfig``, RCEIL) for the recorded modules;
  under autocast their weights and inputs are cast to the autocast dtype (``step.run_values``); not tried where the
  recorded step already trains in MXFP8 with RCEIL scales.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch
from torch.nn.utils import parametrize

from ...errors import AnalyzerError
from ..fixes.registry import Fix, FixSpec, register_fix
from ..result.replay_result import ReplayResult
from ..runs._runs import ReplayContext
from .diagnose import Fp8Evidence, judge_values
from .recipe import filter_source, with_gradients_in
from .step import fp8_context, run_values
from .verdicts import CHANNEL_GAP, NONFINITE, SATURATION, UNDERFLOW, e5m2_applies, keep_high

__all__: list[str] = []


def _evidence(result: ReplayResult) -> Fp8Evidence | None:
    ev = result.evidence.get("fp8")
    return ev if isinstance(ev, Fp8Evidence) else None


def _try(ctx: ReplayContext, result: ReplayResult, name: str, title: str,
         make: Callable[[ReplayContext, Fp8Evidence], ReplayContext],
         prepare: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None = None) -> Fix | None:
    ev = _evidence(result)
    if ev is None:
        return None
    try:
        v = run_values(make(ctx, ev), ev.precision, name, fp8=True, prepare=prepare)
    except (AnalyzerError, RuntimeError, NotImplementedError, ValueError, TypeError) as e:
        why = e.message if isinstance(e, AnalyzerError) else f"{type(e).__name__}: {e}"
        return Fix(name=name, title=title, status="not_tried", precision=ev.precision,
                   detail=f"torchao could not run it here: {why.strip().splitlines()[0][:200]}")
    j = judge_values(v, ev.reference)
    ok = v.finite and j.agrees
    before = ("fails the same test" if not ev.vs_bf16.agrees else "agrees too")
    return Fix(name=name, title=title, status="verified" if ok else "fails", precision=ev.precision,
               loss=v.trace.loss, reference_loss=ev.losses.get("bfloat16"),
               detail=(f"the FP8 step with this fix {'agrees' if ok else 'does not agree'} with BF16 ({j.numbers()}); "
                       f"the unchanged FP8 step {before} ({ev.vs_bf16.numbers()})"))


def _rowwise(ctx: ReplayContext, result: ReplayResult) -> Fix | None:
    def make(c: ReplayContext, _ev: Fp8Evidence) -> ReplayContext:
        from torchao.float8 import Float8LinearConfig  # noqa: PLC0415 - [fp8]: the evidence exists, torchao does

        return fp8_context(c, config=Float8LinearConfig.from_recipe_name("rowwise"))
    return _try(ctx, result, "fp8_rowwise", "rowwise scaling (torchao's rowwise recipe) for the FP8 modules", make)


def _keep_bf16(ctx: ReplayContext, result: ReplayResult) -> Fix | None:
    ev = _evidence(result)
    keep = keep_high(ev) if ev is not None else []
    if not keep:
        return None
    title = f"{', '.join(keep)} kept in BF16 ({filter_source(keep)})"
    return _try(ctx, result, "fp8_keep_bf16", title, lambda c, _ev: fp8_context(c, keep_high=keep))


def _e5m2_grads(ctx: ReplayContext, result: ReplayResult) -> Fix | None:
    ev = _evidence(result)
    if ev is None or not e5m2_applies(ev.nonfinite_cast if ev.nonfinite_at is not None else ev.first):
        return None  # the broken cast is no e4m3 gradient of a float8 recipe
    return _try(ctx, result, "fp8_e5m2_grads", "gradients cast to e5m2 in the recorded recipe",
                lambda c, _ev: fp8_context(c, with_gradients_in(c.fp8_recipe, "float8_e5m2")))


class _Smooth(torch.nn.Module):
    """The weight's columns times the per-channel scale the forward pre-hook set (a parametrization)."""

    def __init__(self):
        super().__init__()
        self.s: torch.Tensor | None = None

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w if self.s is None else w * self.s.to(w.dtype)


@contextlib.contextmanager
def _smoothed(model: torch.nn.Module, name: str) -> Iterator[None]:
    mod = model.get_submodule(name)
    smooth = _Smooth()
    parametrize.register_parametrization(mod, "weight", smooth)

    def pre(_m, args):
        x = args[0]
        w = mod.parametrizations.weight.original
        with torch.no_grad():
            ax = x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float()
            aw = w.detach().abs().amax(0).float()
            s = torch.where((ax > 0) & (aw > 0), (ax / aw.clamp_min(1e-30)).sqrt(), torch.ones_like(ax))
        smooth.s = s
        return (x / s.to(x.dtype), *args[1:])

    handle = mod.register_forward_pre_hook(pre)
    try:
        yield
    finally:
        handle.remove()
        parametrize.remove_parametrizations(mod, "weight", leave_parametrized=False)


def _smooth_swiglu(ctx: ReplayContext, result: ReplayResult) -> Fix | None:
    ev = _evidence(result)
    c = ev.first if ev is not None else None
    if c is None or c.role != "input" or c.channel_gap < CHANNEL_GAP:
        return None  # not the aligned-channel pattern: the outlier is not one channel's alone
    title = (f"Smooth-SwiGLU: `{c.module}`'s input channels divided by a per-channel scale and its weight's "
             "columns multiplied by it")
    return _try(ctx, result, "fp8_smooth_swiglu", title, lambda cx, _ev: fp8_context(cx),
                prepare=lambda model: _smoothed(model, c.module))


def _mxfp8(ctx: ReplayContext, result: ReplayResult) -> Fix | None:
    ev = _evidence(result)
    if ev is None or ev.mxfp8:
        return None  # the step already trains in MXFP8 with RCEIL scales: nothing to change

    def make(c: ReplayContext, _ev: Fp8Evidence) -> ReplayContext:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe  # noqa: PLC0415

        cfg = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
        return fp8_context(c, config=cfg)

    title = "MXFP8 (torchao's emulated MXFP8 training, RCEIL scales) for the FP8 modules"
    if ev.first is not None and ev.first.granularity == "mxfp8_floor":
        title = "RCEIL block scales instead of FLOOR (torchao's emulated MXFP8 training) for the FP8 modules"
    if ctx.mode.autocast and ctx.mode.dtype:
        title += f", their GEMMs' operands in {ctx.mode.dtype} (as autocast casts them)"
    return _try(ctx, result, "fp8_mxfp8", title, make)


def _line(fix: Fix, _c: Mapping, _mode: str) -> str:
    return f"Verified on this step: {fix.title}."


_BOTH = (UNDERFLOW, SATURATION, NONFINITE)
register_fix(FixSpec("fp8_rowwise", "rowwise FP8 scaling", _rowwise, serves=_BOTH, line=_line))
register_fix(FixSpec("fp8_keep_bf16", "the broken modules in BF16", _keep_bf16, serves=_BOTH, line=_line))
register_fix(FixSpec("fp8_e5m2_grads", "e5m2 gradients", _e5m2_grads, serves=_BOTH, line=_line))
register_fix(FixSpec("fp8_smooth_swiglu", "Smooth-SwiGLU", _smooth_swiglu, serves=(UNDERFLOW,), line=_line,
                     applies=lambda v, _c: v == UNDERFLOW))
register_fix(FixSpec("fp8_mxfp8", "MXFP8", _mxfp8, serves=_BOTH, line=_line))

"""The step replayed in FP8 beside FP32 and BF16: its casts, and its gradients and Linear outputs against theirs.

``run_values`` replays the step once (``_runs.run_once``, under the replay's dispatch mode) and keeps,
in FP32, every parameter's gradient and every ``nn.Linear``'s output (``Float8Linear`` included). The FP8
run is the plain model converted with the recorded recipe (``recipe.convert``; torchao's own path,
emulated or not as training ran it), its casts followed by ``casts.CastWatch``. ``agreement`` compares two
runs parameter by parameter: cosine and relative error ``|a - ref| / |ref|``.

A step *agrees* with a reference when every parameter's gradient has cosine at least ``GRAD_COS_TOL`` and
relative error at most ``GRAD_REL_TOL``, and every Linear's output a median per-token relative error
(``output_errors``) at most ``OUT_REL_TOL``. The tolerances leave room for FP8's own rounding (e4m3 keeps
3 mantissa bits: a healthy tensorwise step of the test models is within 0.12 of BF16 in every gradient
and 0.07 in every output). The per-token median is there because a norm over the whole tensor hides a
loss that an outlier's rows dominate: the aligned SwiGLU's tensorwise step flushes w2's input on 62 of
64 tokens, and w2's weight gradient is still within 0.08 of BF16 (its outlier column carries the norm),
while w2's output is 0.88 off on the median token.

NB: the gradients and Linear outputs of three runs are held in FP32 at once: about three times the
model's parameters and activations of the Linears.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping

import torch
from torch.utils._python_dispatch import _disable_current_modes

from recorders.fp8_recipe import fp8_modules

from ..runs._runs import ReplayContext, run_once
from ..result.trace import RunTrace
from .casts import CastWatch, Fp8Cast
from .recipe import convert

__all__ = ["GRAD_COS_TOL", "GRAD_REL_TOL", "OUT_REL_TOL", "StepValues", "Agreement", "run_values", "fp8_context",
           "agreement", "output_errors", "agrees", "worst", "mx_compute_in"]

GRAD_COS_TOL = 0.98  # per parameter: cosine with the reference gradient at least this
GRAD_REL_TOL = 0.2   # per parameter: |g - ref| / |ref| at most this
OUT_REL_TOL = 0.25   # per Linear: the median over tokens of |y - ref| / |ref| at most this


@dataclasses.dataclass(frozen=True)
class StepValues:
    """One run: its trace, its FP8 casts (empty without FP8), its gradients and Linear outputs (FP32)."""

    label: str
    trace: RunTrace
    casts: tuple[Fp8Cast, ...]
    grads: Mapping[str, torch.Tensor] = dataclasses.field(repr=False)
    outputs: Mapping[str, torch.Tensor] = dataclasses.field(repr=False)

    @property
    def finite(self) -> bool:
        return self.trace.finite


@dataclasses.dataclass(frozen=True)
class Agreement:
    """One parameter's (or output's) values against the reference's."""

    name: str
    cosine: float
    rel_err: float

    @property
    def agrees(self) -> bool:
        return self.cosine >= GRAD_COS_TOL and self.rel_err <= GRAD_REL_TOL

    def to_dict(self) -> dict:
        return {"name": self.name, "cosine": _num(self.cosine), "rel_err": _num(self.rel_err)}


def _num(v: float) -> float | None:
    return v if math.isfinite(v) else None


def fp8_context(ctx: ReplayContext, recipe: Mapping | None = None, **convert_kw) -> ReplayContext:
    """A context whose model is `ctx`'s converted with `recipe` (default: the recorded one), built anew."""
    recipe = recipe if recipe is not None else ctx.fp8_recipe
    base = ctx.convert

    def to_fp8(model: torch.nn.Module) -> torch.nn.Module:
        return convert(base(model) if base is not None else model, recipe, path=ctx.path, device=ctx.device.type,
                       **convert_kw)

    return dataclasses.replace(ctx, convert=to_fp8, _model=None)


def _tag_fp8_nodes(name: str, out) -> None:
    """Name the autograd node of a Float8Linear's (or an MXFP8 weight's ``mx_mm``) GEMM: a custom Function the
    function mode never sees."""
    todo = [out.grad_fn] if isinstance(out, torch.Tensor) and out.grad_fn is not None else []
    for _ in range(4):  # the GEMM's node is within a reshape and a bias add of the output
        nxt = []
        for node in todo:
            if node is None:
                continue
            if ("float8" in node.name().lower() or node.name().startswith("mx_mm")) and "module" not in node.metadata:
                node.metadata["module"] = name
            nxt.extend(n for n, _ in node.next_functions)
        todo = nxt


@contextlib.contextmanager
def _capture(model: torch.nn.Module, grads: dict, outputs: dict, extra: Callable | None) -> Iterator[None]:
    """Keep every Linear's output and, at the end, every gradient (FP32 copies, out of the replay's modes)."""
    names = {m: n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}

    def post(mod, _args, out):
        if isinstance(out, torch.Tensor):
            _tag_fp8_nodes(names[mod], out)
            with _disable_current_modes():
                prev = outputs.get(names[mod])
                rows = out.detach().float().reshape(-1, out.shape[-1])  # one row per token
                outputs[names[mod]] = rows if prev is None else torch.cat([prev, rows])

    handles = [m.register_forward_hook(post) for m in names]
    try:
        with extra(model) if extra is not None else contextlib.nullcontext():
            yield
            with _disable_current_modes():
                for n, p in model.named_parameters():
                    if p.grad is not None:
                        grads[n.replace(".parametrizations.", ".").replace(".original", "")] = p.grad.detach().float().clone()
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def mx_compute_in(model: torch.nn.Module, names: set[str], dtype: torch.dtype) -> Iterator[None]:
    """The MXFP8 Linears `names` compute in `dtype`: their weights (torchao's wrapper and the ``_data`` it computes
    with) and their inputs cast to it, for the run; the FP32 weights are put back after.

    NB: torchao 0.18's emulated ``mx_mm`` quantises each operand from its own dtype and multiplies the
    dequantised blocks, so under CPU autocast (an FP32 weight beside a BF16 input) ``mm`` raises on the dtype
    mismatch. torchao's own MXFP8 tests train BF16 parameters without autocast; autocast rounds a Linear's
    weight to BF16 for the matmul all the same, so this is the step autocast would run.
    """
    kept, handles = [], []
    for name in names:
        mod = model.get_submodule(name)
        w = mod.weight
        inner = getattr(w, "_data", None)
        if type(inner) is not torch.Tensor or w.dtype == dtype:
            continue
        kept.append((w, w.data, inner))
        w.data, w._data = w.data.to(dtype), inner.to(dtype)

        def pre(_m, args):
            x = args[0] if args else None
            return (x.to(dtype), *args[1:]) if isinstance(x, torch.Tensor) and x.is_floating_point() else None
        handles.append(mod.register_forward_pre_hook(pre))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for w, data, inner in kept:
            w.data, w._data = data, inner


def run_values(ctx: ReplayContext, precision: str, label: str, *, fp8: bool = False,
               prepare: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None = None) -> StepValues:
    """Replay the step once in `precision` (at loss scale 1) and keep its gradients, Linear outputs and FP8 casts.

    `ctx` is the plain context or an ``fp8_context``; `fp8` follows the casts; `prepare` is a fix's hook. Under
    autocast, the model's MXFP8 Linears compute on operands in the autocast dtype (``mx_compute_in``).
    """
    grads: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}
    watch = CastWatch(mx_wgrad_hp=_mx_wgrad_hp(ctx.fp8_recipe)) if fp8 else None
    low = getattr(torch, ctx.mode.dtype) if fp8 and ctx.mode.autocast and ctx.mode.dtype else None

    @contextlib.contextmanager
    def both(model: torch.nn.Module) -> Iterator[None]:
        mx = {n for n, (kind, _) in fp8_modules(model).items() if kind == "mxfp8"} if low is not None else set()
        with mx_compute_in(model, mx, low) if mx else contextlib.nullcontext():
            with prepare(model) if prepare is not None else contextlib.nullcontext():
                yield

    trace = run_once(ctx, precision, 1.0, casts=watch, prepare=lambda model: _capture(model, grads, outputs, both))
    casts = tuple(watch.finalize()) if watch is not None else ()
    return StepValues(label, trace, casts, grads, outputs)


def _mx_wgrad_hp(recipe: Mapping | None) -> bool:
    """Whether the recipe's MXFP8 configs compute the weight gradient in high precision (``wgrad_with_hp``)."""
    return any(c.get("kind") == "mxfp8" and bool(c.get("fields", {}).get("wgrad_with_hp"))
               for c in (recipe or {}).get("configs", ()))


def agreement(a: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> list[Agreement]:
    """Per name in `ref` (and in `a`), the cosine and relative error of `a`'s values against `ref`'s."""
    out = []
    pairs = [(n, a[n], r) for n, r in ref.items() if n in a and a[n].shape == r.shape]
    if not pairs:
        return out
    rows = []
    for _, x, r in pairs:
        x, r = x.double().flatten(), r.double().flatten()
        rn, xn = r.norm(), x.norm()
        rows.append(torch.stack([(x - r).norm(), rn, xn, (x * r).sum()]))
    values = torch.stack(rows).tolist()  # NB: one sync
    for (n, _, _), (diff, rn, xn, dot) in zip(pairs, values):
        rel = diff / rn if rn > 0 else (0.0 if diff == 0 else math.inf)
        cos = dot / (rn * xn) if rn > 0 and xn > 0 else (1.0 if rn == xn == 0 else 0.0)
        out.append(Agreement(n, cos if math.isfinite(cos) else math.nan, rel if not math.isnan(rel) else math.inf))
    return out


def output_errors(a: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Per Linear (in the order the step called them), the median over tokens of ``|y - ref| / |ref|``."""
    out = {}
    for n, r in ref.items():
        y = a.get(n)
        if y is None or y.shape != r.shape or not r.numel():
            continue
        out[n] = ((y - r).norm(dim=1) / r.norm(dim=1).clamp_min(torch.finfo(torch.float32).tiny)).median()
    values = torch.stack(list(out.values())).tolist() if out else []  # NB: one sync
    return {n: v if v == v else math.inf for n, v in zip(out, values)}


def agrees(rows: list[Agreement], outputs: Mapping[str, float]) -> bool:
    """Every parameter's gradient and every Linear's output within the tolerance (and something compared)."""
    return bool(rows) and all(r.agrees for r in rows) and all(v <= OUT_REL_TOL for v in outputs.values())


def worst(rows: list[Agreement]) -> Agreement | None:
    """The parameter farthest from its reference (the largest relative error; NaN counts as worst)."""
    return max(rows, key=lambda r: (math.inf if math.isnan(r.rel_err) or math.isnan(r.cosine) else r.rel_err),
               default=None)

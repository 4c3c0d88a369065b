"""Where a finite low-precision step's error is born: each forward op against FP32, from the same inputs.

``measure(ctx, precision, scale)`` re-runs the step once in `precision` under the usual op recorder
with one more dispatch mode inside it, ``_ErrorMode``. For every forward op with a floating output it
computes, with every mode off (so the recorder's op indices do not move):

- ``local``: the op recomputed in FP32 from its own low-precision inputs, upcast. Its output's relative
  distance from that, in units of the dtype's eps, is the error the op itself adds. An op computed
  correctly and rounded once to the dtype adds at most eps/2 (normwise, less); an op that accumulates
  in the low precision (``cumprod`` on CPU: every partial product rounded) adds far more.
- ``shadow``: the op computed in FP32 from the *shadows* of its inputs, the FP32 values the step would
  have had if nothing upstream had been rounded; its output's distance from that is the error the
  value carries so far (a shadow of a cast to FP16/BF16 is the value before the cast).

``born(measures, eps)`` names the op where the error is born: the op whose ``local`` error is largest,
when it passes ``LOCAL_K`` eps; else (every op rounds correctly) the op that amplifies the error it
receives the most, ``shadow`` error over its inputs' (a sine of a rounded large angle, an index
computed from a rounded count). Backward ops are not measured: their error follows the forward's.

NB: an in-place op (``masked_fill_``) is recomputed on copies of its inputs and of their shadows, so the
step's own tensors are written once. An op that draws random numbers (dropout's mask) or returns
uninitialised memory is not recomputed: its output is its own shadow, so the mask is the step's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from ..runs._runs import ReplayContext, run_once
from ..result.trace import RunTrace

__all__ = ["LOCAL_K", "OpError", "Born", "measure", "born"]

LOCAL_K = 4.0  # an op's own error beyond this many eps is not one rounding (at most eps/2)
_LOW = (torch.float16, torch.bfloat16)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class OpError:
    """One forward op's error, in units of the dtype's eps (None where it could not be recomputed).

    Attributes:
        index: the op's index in the run (``RunTrace.records``).
        local: its output against its FP32 recomputation from the same low-precision inputs.
        error: its output against its shadow (the FP32 value it would have had, nothing rounded upstream).
        input_error: the largest ``error`` among its floating inputs (0: none carried an error).
        absmax / fp32_absmax: its output's abs-max, and that of the FP32 recomputation from the same inputs.
    """

    index: int
    local: float | None
    error: float | None
    input_error: float
    absmax: float
    fp32_absmax: float | None


@dataclass(frozen=True)
class Born:
    """The op where the step's error is born (``kind="computed"``) or most amplified (``"amplified"``)."""

    kind: str
    op: OpError


def _dist(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return math.nan
    # equal elements differ by 0, -inf against -inf (a mask) included; the norm is that of the finite reference
    ref = float(torch.where(torch.isfinite(b), b, 0).norm())
    d = float(torch.where(a == b, 0, a - b).norm())  # NB: host reads, one per op: this pass is a diagnosis
    return d / ref if ref > 0 else (0.0 if d == 0 else math.inf)


_DRAWS: dict = {}  # OpOverload -> whether recomputing it would not give its values


def _not_recomputed(func) -> bool:
    """An op that draws random numbers (a ``Generator`` argument: dropout's ``bernoulli_``) or returns
    uninitialised memory (``empty_like``): recomputed, it gives other values (and moves the RNG)."""
    known = _DRAWS.get(func)
    if known is None:
        known = _DRAWS[func] = func.__name__.startswith(("empty", "new_empty")) or any(
            "Generator" in str(a.type) for a in func._schema.arguments)
    return known


def _floats(out) -> list[torch.Tensor]:
    flat, _ = tree_flatten(out)
    return [t for t in flat if isinstance(t, torch.Tensor)]


class _ErrorMode(TorchDispatchMode):
    """Measures each forward op's local and carried error (see the module doc); innermost in the run."""

    def __init__(self, eps: float, device_type: str, substitute: frozenset[int] = frozenset(), keep_fp32: bool = False):
        super().__init__()
        self.eps, self.device_type, self.substitute, self.keep_fp32 = eps, device_type, substitute, keep_fp32
        self.substituted = False
        self.index = 0
        self.errors: list[OpError] = []
        self._shadow: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self._err: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        index = self.index
        self.index += 1
        if torch._C._current_graph_task_id() != -1:
            return func(*args, **kwargs)  # backward: not measured
        if _not_recomputed(func):  # a random draw or uninitialised memory: its own values are its shadow
            out = func(*args, **kwargs)
            with _disable_current_modes():  # NB: the recorder outside must not see these copies (op indices)
                for t in _floats(out):
                    self._shadow[t], self._err[t] = t.detach().float(), 0.0
            return out
        # NB: recomputed before the op runs, which may write its inputs in place (div_), on copies then
        with _disable_current_modes(), torch.autocast(self.device_type, enabled=False), torch.no_grad():
            again = self._recompute(func, args, kwargs)
        out = func(*args, **kwargs)
        outs = _floats(out)
        with _disable_current_modes(), torch.autocast(self.device_type, enabled=False), torch.no_grad():
            self._measure(index, outs, *again)
            sh = self._shadow.get(out) if index in self.substitute and isinstance(out, torch.Tensor) else None
            if sh is not None:  # the op from the FP32 values of its inputs, as if nothing upstream were rounded
                self.substituted = True
                return sh.clone() if self.keep_fp32 else sh.to(out.dtype)
        return out

    def _recompute(self, func, args, kwargs) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
        """The op in FP32 from its upcast inputs, and from their shadows; the largest error its inputs carry."""
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        carried = max((self._err.get(a, 0.0) for a in inputs), default=0.0)

        copy = func._schema.is_mutable  # an in-place op runs on copies: the step's own tensors are written once

        def up(x):
            if not isinstance(x, torch.Tensor):
                return x
            x = x.float() if x.dtype in _LOW else x
            return x.clone() if copy else x

        def shadow(x):
            if not isinstance(x, torch.Tensor):
                return x
            s = self._shadow.get(x)
            return up(x) if s is None else (s.clone() if copy else s)

        try:
            ref = tree_map(up, func(*tree_map(up, args), **tree_map(up, kwargs)))
        except Exception:  # noqa: BLE001 - an op that refuses FP32 inputs is left unmeasured
            ref = None
        if func.__name__.startswith("_to_copy") and inputs and inputs[0].dtype in _FLOAT:
            sh = shadow(inputs[0])  # a cast: the shadow is the value before it (a cast to an integer type: cast)
            low_cast = kwargs.get("dtype") in _LOW
            sh_out = sh if low_cast else (sh.to(kwargs["dtype"]) if "dtype" in kwargs else sh)
        else:
            try:
                sh_out = func(*tree_map(shadow, args), **tree_map(shadow, kwargs))
            except Exception:  # noqa: BLE001
                sh_out = None
        return (_floats(ref) if ref is not None else [], _floats(sh_out) if sh_out is not None else [], carried)

    def _measure(self, index: int, outs: list[torch.Tensor], ref_flat: list[torch.Tensor],
                 sh_flat: list[torch.Tensor], carried: float) -> None:
        """Each output against its recomputations: its errors, and its shadow for the ops that read it."""
        first = None
        for i, t in enumerate(outs):
            s = sh_flat[i] if i < len(sh_flat) and sh_flat[i].shape == t.shape else None
            if s is not None and s.dtype in _LOW:
                s = s.float()
            if t.dtype not in _FLOAT:  # an index or a mask: it carries its float inputs' error
                if s is not None:
                    self._shadow[t] = s
                self._err[t] = carried
                continue
            err = _dist(t, s) / self.eps if s is not None else None
            self._shadow[t] = s if s is not None else t.detach().float()
            self._err[t] = err if err is not None and math.isfinite(err) else 0.0
            if first is None:
                r = ref_flat[i] if i < len(ref_flat) and ref_flat[i].shape == t.shape else None
                local = _dist(t, r) / self.eps if r is not None and t.dtype in _LOW else None
                first = OpError(index, local, err, carried, float(t.detach().abs().max()) if t.numel() else 0.0,
                                None if r is None or not r.numel() else float(r.abs().max()))
        if first is not None:
            self.errors.append(first)


def measure(ctx: ReplayContext, precision: str, scale: float, substitute: frozenset[int] = frozenset(),
            keep_fp32: bool = False) -> tuple[RunTrace, list[OpError], bool]:
    """Re-run the step in `precision` with each forward op's error measured (``_ErrorMode``).

    `substitute`: the ops at these indices return their shadows instead, cast to their dtype (or kept in
    FP32 with `keep_fp32`): the step as if those ops' inputs had been computed in FP32 (every op upstream).
    Returns the run, the errors and whether a substitution happened.
    """
    mode = _ErrorMode(float(torch.finfo(getattr(torch, precision)).eps), ctx.device.type, substitute, keep_fp32)

    def prepare(_model):
        return mode

    trace = run_once(ctx, precision, scale, prepare=prepare)
    return trace, mode.errors, mode.substituted


def born(errors: list[OpError]) -> Born | None:
    """The op whose own error passes ``LOCAL_K`` eps the most; else the op that amplifies the most."""
    computed = [e for e in errors if e.local is not None and math.isfinite(e.local) and e.local > LOCAL_K]
    if computed:
        return Born("computed", max(computed, key=lambda e: e.local))
    grown = [e for e in errors if e.error is not None and math.isfinite(e.error) and e.error > LOCAL_K]
    if not grown:
        return None
    return Born("amplified", max(grown, key=lambda e: e.error / max(e.input_error, 0.5)))

"""The FP8 casts of a replayed step, read from the ops the dispatch mode sees, and where each one went.

A torchao ``Float8Linear`` casts each GEMM operand with plain ATen ops (``PYTORCH-NOTES.md``)::

    abs -> max|amax -> ... -> reciprocal -> mul(max) -> scale;  mul(x, scale) -> clamp(+-max) -> _to_copy(float8)

and hands the float8 result to ``aten.mm`` inside a ``Float8TrainingTensor`` (``._data``, ``._scale``,
``._gemm_input_role``). ``CastWatch`` follows that chain: at the ``_to_copy`` to a float8 dtype it finds
the clamp's input (the scaled values *before* the clamp: CPU casts saturate e4m3 silently, so the cast's
result is no evidence) and the ``mul`` that made it (the cast's input and its scale), and queues
``recorders.fp8.scaled_counts`` on device (saturated, flushed, subnormal: one implementation). At the
``mm`` that reads the float8 data it learns the operand's role (``input``, ``weight``, ``grad_output``)
and which GEMM used it (``forward``, ``input gradient``, ``weight gradient``). Everything comes to the
host in ``finalize`` with the run's other statistics.

An MXFP8 training weight (torchao's ``mx_mm``, emulated) casts each operand in blocks of 32 with the same
plain ops, ``x * scale`` (RCEIL) or ``x / scale`` (FLOOR) on a ``(rows, blocks, 32)`` view, then ``clamp`` and
``_to_copy``; its GEMM reads ``MXTensor`` arguments (``.qdata``), which carry no role: ``_mx_roles`` gives them
from ``mx_mm``'s order of GEMMs.

Example (one tensorwise Float8Linear, forward and backward: six casts)::

    >>> watch = CastWatch()                                    # doctest: +SKIP
    >>> trace = run_once(fp8_ctx, "bfloat16", 1.0, casts=watch)  # doctest: +SKIP
    >>> [(c.role, c.use, c.fmt) for c in watch.finalize()][:3]  # doctest: +SKIP
    [('input', 'forward', 'e4m3'), ('weight', 'forward', 'e4m3'), ('grad_output', 'input gradient', 'e5m2')]
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from recorders.fp8 import MX_BLOCK, CastStats, scaled_counts

__all__ = ["FLOAT8_DTYPES", "Fp8Cast", "CastWatch", "dequantised"]

FLOAT8_DTYPES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def dequantised(t: torch.Tensor) -> torch.Tensor | None:
    """The values an FP8 tensor stands for, as FP32: a float8 tensor as is, a torchao ``Float8TrainingTensor``
    as ``_data / _scale``, an ``MXTensor`` by its own ``dequantize``; None for another tensor subclass."""
    if t.dtype in FLOAT8_DTYPES:
        return t.float()
    data, scale = getattr(t, "_data", None), getattr(t, "_scale", None)
    if isinstance(data, torch.Tensor) and data.dtype in FLOAT8_DTYPES and isinstance(scale, torch.Tensor):
        return data.float() / scale.float()
    if type(t).__name__ == "MXTensor" and callable(getattr(t, "dequantize", None)):  # torchao's MX blocks
        return t.dequantize(torch.float32)
    return None


@dataclasses.dataclass(frozen=True)
class Fp8Cast:
    """One FP8 cast of the step.

    Attributes:
        index: the op index of its ``_to_copy`` in the run (``RunTrace.records``).
        module, phase: where it ran (``phase``: the pass, ``forward`` or ``backward``).
        role: ``input``, ``weight`` or ``grad_output`` (None: no GEMM read it).
        use: the GEMM that read it: ``forward``, ``input gradient`` or ``weight gradient``.
        fmt, granularity: ``e4m3`` / ``e5m2``; ``tensorwise`` (one scale), ``rowwise`` (a scale per row or column),
            ``mxfp8`` / ``mxfp8_floor`` (an e8m0 scale per block of 32, RCEIL / FLOOR rounding).
        stats: saturated (before the clamp), flushed and subnormal counts (``recorders.fp8.CastStats``).
        shape: the shape of the cast's input.
        outlier: ``(row, column)`` of its largest |value| in the input flattened to 2-D around its last
            dim: the value whose amax set a tensorwise scale; ``column`` is the channel (feature) index.
        channel_gap: the largest channel amax over the second largest (inf when only one channel is
            non-zero, 1 for one channel): the aligned-channel pattern puts one channel far above the others.
    """

    index: int
    module: str
    phase: str
    role: str | None
    use: str | None
    fmt: str
    granularity: str
    stats: CastStats
    shape: tuple[int, ...]
    outlier: tuple[int, int]
    channel_gap: float = 1.0

    @property
    def where(self) -> str:
        return f"{self.module} {self.role or 'operand'} ({self.use or self.phase}, {self.fmt} {self.granularity})"

    def to_dict(self) -> dict:
        return {"index": self.index, "module": self.module, "phase": self.phase, "role": self.role, "use": self.use,
                "shape": list(self.shape), "outlier": {"row": self.outlier[0], "column": self.outlier[1]},
                "channel_gap": self.channel_gap if self.channel_gap != float("inf") else None,
                **self.stats.to_dict()}


class CastWatch:
    """Follows ``mul -> clamp -> _to_copy(float8) -> mm`` through one run (module doc); private to a run."""

    def __init__(self, mx_wgrad_hp: bool = False):
        self.mx_wgrad_hp = mx_wgrad_hp  # an MXFP8 recipe whose weight gradient is computed in high precision
        self._mx_backward: dict[str, int] = {}  # MX GEMMs seen per module in backward (their roles alternate)
        self._muls = WeakTensorKeyDictionary()    # mul (or div) output -> (its tensor input, its scale, divides)
        self._clamps = WeakTensorKeyDictionary()  # clamp output -> the clamp's input (x * scale)
        self._by_data: dict[int, int] = {}        # float8 storage -> its cast (views share it)
        self._pending: list[dict] = []
        self._counts: list[torch.Tensor] = []

    def op(self, name: str, args: tuple, out, rec) -> None:
        """Called by the dispatch mode after each op with its record (index, module, phase)."""
        if name == "aten.mul":
            self._mul(args, out)
        elif name == "aten.clamp" and args and isinstance(args[0], torch.Tensor) and args[0] in self._muls:
            self._clamps[out] = args[0]
        elif name == "aten._to_copy" and isinstance(out, torch.Tensor) and out.dtype in FLOAT8_DTYPES:
            self._cast(args[0], out, rec)
        elif name == "aten.div":
            self._mul(args, out, divides=True)
        elif name in ("aten.mm", "aten._scaled_mm"):
            self._gemm(args, rec)

    def _mul(self, args: tuple, out, divides: bool = False) -> None:
        """``x * scale`` (torchao's float8 casts, MX RCEIL) or ``x / scale`` (MX FLOOR: the scale is its inverse)."""
        if len(args) < 2 or not all(isinstance(a, torch.Tensor) for a in args[:2]) or not isinstance(out, torch.Tensor):
            return
        x, s = args[0], args[1]
        if s.numel() > x.numel():
            if divides:
                return
            x, s = s, x
        if x.shape == out.shape and x.dim() >= 1 and s.numel() < x.numel():
            self._muls[out] = (x, s, divides)

    def _cast(self, src: torch.Tensor, out: torch.Tensor, rec) -> None:
        xs = self._clamps.get(src)
        if xs is None or xs not in self._muls:
            return  # a cast with no scale the step computed (not a torchao training cast)
        x, scale, divides = self._muls[xs]
        fmt = FLOAT8_DTYPES[out.dtype]
        counts = scaled_counts(x, xs, 1.0 / scale if divides else scale, fmt)
        ax = x.detach().abs().float()
        where = ax.flatten().argmax().double().reshape(1)  # the value that set the scale
        # Two layouts of the operand as (rows, channels): its last dim as the channels, and, where it may be MX
        # blocks (a (rows, blocks, 32) view with a scale per block), (rows, K). The GEMM that reads the cast says
        # which (``_gemm``); both gaps are computed here, while the operand is alive.
        widths = [x.shape[-1] if x.dim() >= 1 else 1]
        if x.dim() >= 3 and x.shape[-1] == MX_BLOCK and scale.dim() == x.dim() and scale.shape[-1] == 1:
            widths.append(x.shape[-2] * x.shape[-1])
        gaps = [self._gap(ax.reshape(-1, w)) for w in widths]
        self._counts.append(torch.cat([counts, where, gaps[0], gaps[-1]]))
        self._by_data[out.untyped_storage().data_ptr()] = len(self._pending)
        self._pending.append({"index": rec.index, "module": rec.module, "phase": rec.phase, "role": None,
                              "use": None, "fmt": fmt, "shape": tuple(x.shape), "widths": widths, "floor": divides,
                              "granularity": "tensorwise" if scale.numel() == 1 else "rowwise"})

    @staticmethod
    def _gap(ax: torch.Tensor) -> torch.Tensor:
        """The largest channel amax over the second largest (1 for one channel), as a 1-element float64 tensor."""
        top = ax.amax(0).topk(min(2, ax.shape[-1])).values.double()
        return (top[0] / top[1] if top.numel() == 2 else torch.ones((), dtype=torch.float64)).reshape(1)

    def _gemm(self, args: tuple, rec) -> None:
        found = []
        mx = [type(a).__name__ == "MXTensor" for a in args[:2]]
        for k, a in enumerate(args[:2]):
            data = getattr(a, "qdata" if mx[k] else "_data", None)
            if isinstance(data, torch.Tensor) and data.dtype in FLOAT8_DTYPES:
                i = self._by_data.get(data.untyped_storage().data_ptr())
                role = getattr(getattr(a, "_gemm_input_role", None), "value", None)
                found.append((i, role, mx[k]))
        if any(mx) and len(found) == 2:
            found = [(i, r, True) for (i, _r, _), r in zip(found, self._mx_roles(rec))]
        for i, _role, is_mx in found:
            if is_mx and i is not None:
                self._pending[i]["granularity"] = "mxfp8_floor" if self._pending[i]["floor"] else "mxfp8"
        roles = {r for _, r, _ in found}
        use = "forward" if rec.phase == "forward" else "input gradient" if "weight" in roles else "weight gradient"
        for i, role, _ in found:
            if i is not None and self._pending[i]["use"] is None:
                self._pending[i].update(role=role, use=use)

    def _mx_roles(self, rec) -> tuple[str, str]:
        """The operand roles of an MX GEMM's two arguments. ``MXTensor`` carries no role: torchao's ``mx_mm``
        computes ``input @ weight.t()`` forward, then per backward ``grad_output @ weight`` (input gradient) and,
        unless ``wgrad_with_hp``, ``grad_output.t() @ input`` (weight gradient), in that order. So a module's
        backward alternates weight and input as the second operand, starting again with weight at each call
        whose weight gradient is high precision (``mx_wgrad_hp``: one MX GEMM per backward)."""
        if rec.phase == "forward":
            return "input", "weight"
        if self.mx_wgrad_hp:
            return "grad_output", "weight"
        n = self._mx_backward.get(rec.module, 0)
        self._mx_backward[rec.module] = n + 1
        return "grad_output", "weight" if n % 2 == 0 else "input"

    def finalize(self) -> list[Fp8Cast]:
        """The casts, in the order the step made them. NB: one host sync (call after the run's own)."""
        if not self._counts:
            return []
        values = torch.stack([c.cpu() for c in self._counts]).tolist()  # NB: sync
        out = []
        for p, v in zip(self._pending, values):
            stats = CastStats.from_counts(p["fmt"], p["granularity"], v[:8])
            flat = int(v[8])
            mx = p["granularity"].startswith("mxfp8") and len(p["widths"]) == 2  # the (rows, K) layout of MX blocks
            cols, gap = (p["widths"][1], v[10]) if mx else (p["widths"][0], v[9])
            shape = (math.prod(p["shape"]) // cols, cols) if mx else p["shape"]
            out.append(Fp8Cast(p["index"], p["module"], p["phase"], p["role"], p["use"], p["fmt"], p["granularity"],
                               stats, shape, (flat // cols, flat % cols),
                               gap if gap == gap else 1.0))  # 0 / 0: an all-zero operand
        self._counts.clear()
        return out

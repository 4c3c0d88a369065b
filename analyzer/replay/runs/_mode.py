"""The private dispatch mode that records per-op statistics of one replay run, on device.

Every ATen (and custom ``torch.library``) op of the forward and the backward passes through
``_OpStatsMode.__torch_dispatch__``. For each op it keeps, as 0-d tensors on the op's device:

- the ``aminmax`` of every floating input (taken *before* the op runs: in-place ops mutate)
  and of every floating output; ``aminmax`` propagates NaN and +-inf, so one cheap read gives
  both "is it finite" and the abs-max;
- optionally (``zeros=True``) the non-zero count of every floating output, for the underflow
  check. ``count_nonzero`` costs ~4x an ``aminmax`` on FP16, so the first pass of a replay
  leaves it off and only the diagnosis pass turns it on.

Host-side, it keeps an ``_OpRecord`` per op (name, phase, module, source, which op produced
each input). Nothing is moved to the host until ``finalize()``, which stacks all statistics
and syncs once.

Inputs produced by an earlier op reuse that op's output statistic (tracked by tensor identity
and version counter), so most tensors are read once, not twice.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from ._attribution import _flat, user_source
from ._cache import Memo
from ._writes import BufferReads, unread_args, written_args
from ..fp8.casts import FLOAT8_DTYPES, CastWatch, dequantised

__all__: list[str] = []

# FP8 values are read dequantised (``fp8.casts.dequantised``): a float8 tensor as FP32, a torchao
# Float8TrainingTensor as data / scale (float8 kernels lack aminmax)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, *FLOAT8_DTYPES)

# Ops whose output holds exactly the values of their (first) input: the output statistic is
# the input's, no kernel needed. (Slices and selects hold a subset, so they are measured.)
# Widening casts (FP16/BF16 -> FP32) are treated the same way, see _widens.
_ALIAS_OPS = frozenset({
    "aten.detach", "aten.alias", "aten.view", "aten._unsafe_view", "aten.t", "aten.transpose",
    "aten.permute", "aten.expand", "aten.unsqueeze", "aten.squeeze", "aten.reshape",
    "aten._reshape_alias", "aten.clone", "aten.contiguous", "aten.lift_fresh",
})


_NAMES = Memo()  # OpOverload -> "aten.bmm"


@dataclass(slots=True)
class _OpRecord:
    """One op as seen by the dispatch mode. Statistic indices point into the run's stat arrays."""

    index: int
    name: str                 # "aten.bmm", "mylib.sumsq"
    overload: str             # "default", "Tensor", ...
    namespace: str            # "aten", "prims", "mylib"
    phase: str                # "forward" | "backward"
    module: str               # "blocks.1.attn", "<loss_fn>", "<loss_scale>", "<autograd>"
    source: str | None        # "model.py:42" (in backward: the forward line that made the node)
    node: str | None          # autograd node name in backward, e.g. "SqrtBackward0"
    inputs: list[tuple[int, int | None]] = field(default_factory=list)  # (stat, producer op)
    outputs: list[int] = field(default_factory=list)                    # stat per float output
    zeros: list[tuple[int, int]] = field(default_factory=list)          # (nonzero stat, numel)
    in_dtypes: tuple = ()     # torch.dtype of the floating inputs (unordered)
    out_dtype: torch.dtype | None = None
    literal_nonfinite: bool = False   # a non-tensor argument is NaN/Inf (masked_fill(-inf), full(-inf))
    reads_param: bool = False         # an input is an nn.Parameter: the values downstream derive from the weights


class _OpStatsMode(TorchDispatchMode):
    """Record per-op statistics of one run. Private: driven by ``analyzer.replay.runs._runs``.

    Args:
        zeros: also count non-zero output elements (slower; for the underflow check).
        capture: op index whose inputs to clone (before it runs) for the shadow check.
        on_ops: optional callback, called with the number of ops so far every 256 ops.
        reads: follow these buffers' values through the run (which ones the step reads).
        casts: follow the step's FP8 casts (``fp8.casts.CastWatch``: the FP8 replay).
        override: op index -> ``fn(func, args, kwargs)`` computing that op's output instead of
            ``func`` (a counterfactual fix: the culprit op alone in FP32, ``replay.fixes``). The
            mode is off inside it, so its own ops are not recorded and later indices do not move.

    NB: the running statistics a train-mode batch norm updates in place are not inputs of
    that op here (``_writes.unread_args``): its output never depends on them.
    """

    def __init__(self, *, zeros: bool = False, capture: int | None = None, on_ops=None,
                 reads: BufferReads | None = None, override: dict | None = None, casts: CastWatch | None = None):
        super().__init__()
        self.casts = casts
        self.override = override
        self.reads = reads
        self.zeros = zeros
        self.on_ops = on_ops  # called with the op count every 256 ops (a progress bar)
        self.capture = capture
        self.captured: tuple[Any, Any] | None = None
        # the op that raised (an FP16 cast of a constant beyond 65504): its record, the exception and the
        # Python numbers it was given; the record is the run's last
        self.raised: tuple[_OpRecord, BaseException, list[float]] | None = None
        self.records: list[_OpRecord] = []
        self.module_stack: list[str] = []   # pushed/popped by the module hooks
        self.current_source: str | None = None  # set by the function mode around each call
        self._mins: list[torch.Tensor] = []
        self._maxs: list[torch.Tensor] = []
        self._nonzero: list[torch.Tensor] = []
        self._producers: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    # -- statistics --------------------------------------------------------------------------
    def add_stat(self, t: torch.Tensor) -> int:
        """Queue the aminmax of `t` (no sync) and return its statistic index."""
        mn, mx = torch.aminmax(_values(t.detach()))
        self._mins.append(mn)
        self._maxs.append(mx)
        return len(self._maxs) - 1

    def producer_of(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(op index, stat index) of the op that last wrote `t`, if it is unchanged since."""
        entry = self._producers.get(t)
        if entry is None or not entry[2] <= t._version <= entry[3]:
            return None
        return entry[0], entry[1]

    @staticmethod
    def _is_scalar(t: torch.Tensor) -> bool:
        # 0-d CPU tensors with no producer are wrapped Python numbers (x * 0.5, where(m, x, -inf))
        # or tiny constants: read them on the host (no device sync: they live on the CPU).
        return t.dim() == 0 and t.device.type == "cpu"

    # -- the hook ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _NAMES.get(func)
        if name is None:
            name = _NAMES[func] = str(func.overloadpacket)
        skip = unread_args(name, func, args, kwargs)
        float_in = []
        tensors_in = []
        literal = False  # a NaN/Inf written on purpose: masked_fill(m, -inf), full(..., -inf)
        for a in (_flat(args) + _flat(kwargs.values()) if kwargs else _flat(args)):
            if isinstance(a, torch.Tensor):
                tensors_in.append(a)
                if a.dtype in _FLOAT_DTYPES and a.numel() > 0 and not any(a is s for s in skip):
                    float_in.append(a)
            elif isinstance(a, float) and not math.isfinite(a):
                literal = True
        index = len(self.records)
        rec = self._describe(func, name, index)
        rec.in_dtypes = tuple({a.dtype for a in float_in})
        # Input statistics BEFORE the op runs: an in-place op would overwrite them.
        inputs = []
        for a in float_in:
            known = self.producer_of(a)
            if known is not None:
                inputs.append((known[1], known[0]))
            elif self._is_scalar(a):
                literal = literal or not math.isfinite(a.item())
            else:
                inputs.append((self.add_stat(a), None))
                rec.reads_param = rec.reads_param or isinstance(a, torch.nn.Parameter)
        rec.inputs = inputs
        rec.literal_nonfinite = literal
        if index == self.capture:
            self.captured = (tree_map(_clone_tensor, args), tree_map(_clone_tensor, kwargs))

        fn = self.override.get(index) if self.override else None
        try:
            out = func(*args, **kwargs) if fn is None else fn(func, args, kwargs)
        except Exception as e:
            if self.raised is None:  # NB: the first op that raised; later ones are its consequences
                numbers = [float(a) for a in _flat(args) + _flat(list(kwargs.values()))
                           if isinstance(a, (int, float)) and not isinstance(a, bool)]
                self.records.append(rec)
                self.raised = (rec, e, numbers)
            raise

        flat_out = _flat(out) if isinstance(out, (list, tuple)) else [out]
        # NB: autograd bumps the version counter of an in-place op's output after this hook
        # returns, and gives a view its base's counter then: an output that is a written
        # argument is valid one version on, a view at up to its inputs' versions.
        written = written_args(func, args, kwargs)
        view_hi = max((a._version for a in tensors_in), default=0) if _returns_view(func) else 0
        if self.reads is not None:
            self.reads.op(func, args, kwargs, tensors_in, skip, flat_out, rec.phase == "backward")
        alias = len(rec.inputs) == len(float_in) >= 1 and (
            name in _ALIAS_OPS or (name == "aten._to_copy" and _widens(float_in[0].dtype, out)))
        for t in flat_out:
            if not isinstance(t, torch.Tensor) or t.dtype not in _FLOAT_DTYPES or t.numel() == 0:
                continue
            if rec.out_dtype is None:
                rec.out_dtype = t.dtype
            stat = rec.inputs[0][0] if alias else self.add_stat(t)
            rec.outputs.append(stat)
            if self.zeros:
                self._nonzero.append(torch.count_nonzero(_values(t)))
                rec.zeros.append((len(self._nonzero) - 1, t.numel()))
            hi = t._version + 1 if any(t is w for w in written) else max(t._version, view_hi)
            self._producers[t] = (index, stat, t._version, hi)
        # Written but not returned (out=, running stats; NB: native_batch_norm writes them without
        # saying so in its schema, nor bumping their version): no longer what was recorded.
        for w in written + skip:
            if not any(w is t for t in flat_out):
                self._producers.pop(w, None)
        if self.casts is not None:
            self.casts.op(name, args, out, rec)
        self.records.append(rec)
        if self.on_ops is not None and not index & 255:
            self.on_ops(index)
        return out

    def _describe(self, func, name: str, index: int) -> _OpRecord:
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward:
            node = torch._C._current_autograd_node()
            meta = node.metadata if node is not None else {}
            node_name = node.name() if node is not None else None
            module = meta.get("module")
            if module is None:
                module = "<accumulate_grad>" if node_name and "AccumulateGrad" in node_name else "<autograd>"
            source = meta.get("source")
            phase = "backward"
        else:
            node_name = None
            module = self.module_stack[-1] if self.module_stack else "<loss_fn>"
            source = self.current_source or user_source()
            phase = "forward"
        return _OpRecord(index=index, name=name, overload=func._overloadname,
                         namespace=func.namespace, phase=phase, module=module, source=source,
                         node=node_name)

    # -- the one host sync -------------------------------------------------------------------
    def finalize(self) -> tuple[list[float], list[int]]:
        """Stack all statistics and move them to the host. This is the run's one sync point."""
        if self._maxs:
            mins, maxs = _stack(self._mins), _stack(self._maxs)
            absmax = torch.maximum(mins.abs(), maxs.abs()).tolist()  # NB: sync
        else:
            absmax = []
        nonzero = torch.stack(self._nonzero).tolist() if self._nonzero else []  # NB: sync
        self._mins.clear()
        self._maxs.clear()
        self._nonzero.clear()
        return absmax, nonzero


_VIEWS = Memo()  # OpOverload -> whether it returns a view of an input (Tensor(a) return)


def _returns_view(func) -> bool:
    view = _VIEWS.get(func)
    if view is None:
        view = _VIEWS[func] = any(r.alias_info is not None and not r.alias_info.is_write
                                  for r in func._schema.returns)
    return view


def _widens(src: torch.dtype, out) -> bool:
    """A cast to a dtype that holds every value of `src` exactly: the abs-max cannot change."""
    dst = out.dtype if isinstance(out, torch.Tensor) else None
    return (src in (torch.float16, torch.bfloat16) and dst in (torch.float32, torch.float64)) or (
        src == torch.float32 and dst == torch.float64)


def _values(t: torch.Tensor) -> torch.Tensor:
    """`t`, or the FP32 values of an FP8 tensor (float8 kernels lack aminmax and count_nonzero)."""
    if type(t) is torch.Tensor and t.dtype not in FLOAT8_DTYPES:
        return t
    d = dequantised(t)
    return t if d is None else d


def _stack(scalars: list[torch.Tensor]) -> torch.Tensor:
    """One float64 vector of 0-d statistics (stack promotes FP16/BF16/FP32 to their common dtype)."""
    try:
        return torch.stack(scalars).double()
    except RuntimeError:  # statistics on several devices (a model split across GPUs)
        dev = scalars[0].device
        return torch.stack([s.to(dev, torch.float64) for s in scalars])


def _clone_tensor(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else x

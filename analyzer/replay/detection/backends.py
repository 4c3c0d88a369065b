"""Attention backends in replay: which SDPA kernel ran, and whether the NaN depends on it.

``F.scaled_dot_product_attention`` dispatches each call to one of several kernels, and they fail
differently: the math backend with reduced precision overflows QKᵀ in FP16
(pytorch/pytorch#119131) while the fused kernels keep the logits in FP32, and the fused kernels
had NaN bugs of their own (#110213, #121558). A replay that does not know which kernel ran can
blame precision for a kernel bug. This module

- restores the snapshot's recorded SDPA switches for every replay run (``sdpa_switches``), so
  replay runs the kernel training ran;
- records every SDPA call of a run (``_SdpaCallMode``): the op range it dispatched to and the
  backend, named from the ops the dispatch mode saw (``aten._scaled_dot_product_flash_attention*``
  is ``flash``, ``*_efficient_attention*`` is ``mem_efficient``, ``*_cudnn_attention*`` is
  ``cudnn``, a decomposition into ``bmm``/``_safe_softmax`` is ``math``);
- names the SDPA call an op belongs to (``call_of``), which the diagnosis re-runs under each
  other backend (``_diagnose.try_backends``): ``{"flash": "finite", "mem_efficient": "unavailable: CUDA only", ...}``.

NB: an SDPA call made inside another torch function (``nn.MultiheadAttention`` calls it from
``F.multi_head_attention_forward``) is not seen by the function mode: its fused kernels are
still named by their ops, its math decomposition is not.

Example:
    >>> result = replay_snapshot("run/snapshots/step00000003-r00000-nonfinite_loss.pt")  # doctest: +SKIP
    >>> result.verdict, result.sdpa_backend, result.backends  # doctest: +SKIP
    ('kernel_specific', 'math', {'flash': 'finite', 'mem_efficient': 'unavailable: CUDA only',
     'cudnn': 'unavailable: CUDA only'})
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from recorders import schema

from ..runs._attribution import _flat, user_source

__all__ = ["SdpaCall", "CUDA_ONLY", "sdpa_switches", "record_calls", "fused_backend", "call_of", "backend_of"]

_SDP = {"flash": SDPBackend.FLASH_ATTENTION, "mem_efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}
# Fused-kernel op names (forward and backward) -> backend. Checked by prefix, longest first:
# "aten._scaled_dot_product_flash_attention_for_cpu" is CPU's flash kernel.
_FUSED = (
    ("aten._scaled_dot_product_efficient_attention", "mem_efficient"),
    ("aten._scaled_dot_product_flash_attention", "flash"),
    ("aten._scaled_dot_product_cudnn_attention", "cudnn"),
    ("aten._scaled_dot_product_fused_attention_overrideable", "overrideable"),
    ("aten._efficient_attention", "mem_efficient"),
    ("aten._flash_attention", "flash"),
)
CUDA_ONLY = ("mem_efficient", "cudnn")  # backends with no CPU kernel


def fused_backend(op: str) -> str | None:
    """The backend a fused SDPA op belongs to (``aten._scaled_dot_product_flash_attention_for_cpu``
    -> ``flash``), None for any other op."""
    return next((b for prefix, b in _FUSED if op.startswith(prefix)), None)


@dataclass
class SdpaCall:
    """One ``F.scaled_dot_product_attention`` call of a replay run.

    ``start``/``end``: the forward op indices it dispatched to (``records[start:end]``);
    ``nodes``: the names of the autograd nodes it created, whose backward ops (same module and
    source line) belong to it too.
    """

    start: int
    end: int
    module: str
    source: str | None
    backend: str | None = None
    nodes: frozenset = field(default_factory=frozenset)


class _SdpaCallMode(TorchFunctionMode):
    """Record the op range, module, source line and created autograd nodes of each SDPA call."""

    def __init__(self, stats_mode):
        super().__init__()
        self.stats_mode = stats_mode
        self.calls: list[SdpaCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or torch._C._current_graph_task_id() != -1:
            return func(*args, **kwargs)
        records = self.stats_mode.records
        stack = self.stats_mode.module_stack
        start = len(records)
        out = func(*args, **kwargs)
        call = SdpaCall(start, len(records), stack[-1] if stack else "<loss_fn>", user_source(),
                        nodes=_new_nodes(out, (args, kwargs)))
        names = [r.name for r in records[start:call.end]]
        call.backend = next((b for b in map(fused_backend, names) if b), "math" if names else None)
        self.calls.append(call)
        return out


def _new_nodes(out, inputs) -> frozenset:
    """Names of the autograd nodes reachable from `out` that this call created (stop at the inputs')."""
    if not isinstance(out, torch.Tensor) or out.grad_fn is None:
        return frozenset()
    stop = {id(t.grad_fn) for t in _flat(inputs[0]) + _flat(inputs[1].values())
            if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    names, todo, seen = set(), [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in stop or id(node) in seen:
            continue
        seen.add(id(node))
        names.add(node.name())
        todo.extend(nxt for nxt, _ in node.next_functions)
    return frozenset(names)


@contextlib.contextmanager
def sdpa_switches(recorded: dict | None, only: str | None = None, device: str = "cpu"):
    """Within: the SDPA switches as `recorded` (a snapshot's ``sdpa``), or only backend `only`.

    Also sets the math backend's reduced-precision switch as recorded, and restores everything
    on exit. With nothing recorded (a version-2 snapshot) and no `only`, the process's own
    switches apply; so they do when no recorded backend exists on `device` (a CUDA run that
    allowed only the memory-efficient kernel, replayed on CPU).
    """
    enabled = (recorded or {}).get("enabled") or {}
    wanted = [only] if only else [b for b in schema.SDPA_BACKENDS if enabled.get(b)
                                  and (device == "cuda" or b not in CUDA_ONLY)]
    reduced = (recorded or {}).get("math_reduced_precision")
    cuda = torch.backends.cuda
    before = cuda.fp16_bf16_reduction_math_sdp_allowed() if reduced is not None else None
    with contextlib.ExitStack() as stack:
        if wanted:  # every switch off cannot have run: then the process's switches apply
            stack.enter_context(sdpa_kernel([_SDP[b] for b in wanted]))
        if reduced is not None:
            cuda.allow_fp16_bf16_reduction_math_sdp(bool(reduced))
            stack.callback(cuda.allow_fp16_bf16_reduction_math_sdp, before)
        yield


def record_calls(stats_mode) -> _SdpaCallMode:
    """The function mode that records the SDPA calls of one run (enter it around the run)."""
    return _SdpaCallMode(stats_mode)


def call_of(calls: list[SdpaCall], rec) -> SdpaCall | None:
    """The SDPA call op record `rec` belongs to, or None when it is no part of attention.

    Forward ops belong to the call whose op range holds them; backward ops to the call with their
    module and source line that created their autograd node. A fused kernel's op is SDPA even
    when the call was not seen (made inside another torch function).
    """
    if rec.phase == "forward":
        found = next((c for c in calls if c.start <= rec.index < c.end), None)
    else:
        found = next((c for c in calls if c.module == rec.module and c.source == rec.source
                      and rec.node is not None and rec.node in c.nodes), None)
    fused = fused_backend(rec.name)
    if found is None and fused is not None:
        return SdpaCall(rec.index, rec.index + 1, rec.module, rec.source, fused)
    return found


def backend_of(calls: list[SdpaCall]) -> str | None:
    """The backend(s) a run's SDPA calls ran: ``"math"``, ``"flash"``; ``"flash+math"`` when they
    differ between calls; None when the step has no SDPA call."""
    seen = sorted({c.backend for c in calls if c.backend})
    return "+".join(seen) or None

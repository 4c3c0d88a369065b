"""Module and source-line attribution for replayed ops, in forward and backward.

Forward: per-module pre/post hooks keep a stack of module paths (``blocks.1.attn``); an op
belongs to the innermost module running. Ops outside any module belong to ``<loss_fn>``.

Backward: ``torch.utils.module_tracker.ModuleTracker`` is ambiguous there (siblings sharing an
input show up together, the loss module is never entered). Instead a ``TorchFunctionMode``
tags, after each forward torch call, the autograd nodes that call created with
``node.metadata["module"]`` and ``["source"]``; inner calls run first and outer ones never
overwrite. In backward the dispatch mode reads ``torch._C._current_autograd_node().metadata``.

The same function mode can emulate CUDA's autocast policy on CPU (see ``CUDA_FP32_OPS``).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ._cache import Memo

__all__ = ["user_source", "shown_source", "source_path", "sources_relative_to", "attach_module_hooks", "CUDA_FP32_OPS"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# analyzer/replay/, every subpackage included: a frame there is the replay's own code, not the user's
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_OWN_HOOKS = frozenset({"user_source", "__torch_function__", "__torch_dispatch__", "_describe"})
_SKIP_FILES = ("<frozen ", "contextlib.py")

# Ops that CUDA autocast runs in FP32 (its "fp32" and "fp32_set_opt_dtype" lists) but CPU
# autocast leaves in the input's dtype. Matched by the torch function's __name__.
CUDA_FP32_OPS = frozenset({
    "softmax", "log_softmax", "layer_norm", "group_norm", "exp", "expm1", "log", "log2",
    "log10", "log1p", "reciprocal", "rsqrt", "pow", "__pow__", "softplus", "sum", "cumsum",
    "cumprod", "prod", "norm", "logsumexp", "acos", "asin", "cosh", "sinh", "tan", "erfinv",
    "cosine_similarity", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
    "nll_loss", "cross_entropy", "binary_cross_entropy_with_logits", "dist", "cdist",
    "renorm", "vector_norm",
})


def user_source() -> str | None:
    """``file:line`` of the innermost frame outside torch and this package (cheap frame walk).

    None when the op was issued by the replay itself (``loss * scale``), not by user code.
    """
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_HERE):
            if frame.f_code.co_name not in _OWN_HOOKS:
                return None
        elif not filename.startswith(_TORCH_DIR) and not filename.endswith(_SKIP_FILES) \
                and not filename.startswith("<frozen"):
            return shown_source(filename, frame.f_lineno)
        frame = frame.f_back
    return None


def shown_source(filename: str, line: int) -> str:
    """``file:line`` as ``user_source`` shows it (relative to the run's directory while a snapshot replays)."""
    key = (_BASE[0] or os.getcwd(), filename)
    shown = _SHOWN.get(key)
    if shown is None:
        shown = _SHOWN[key] = _shown_name(filename, key[0])
    return f"{shown}:{line}"


_SHOWN: Memo = Memo()  # (base, file name) -> its shown (shortened) name
# The directory source lines are shown relative to: the run's recorded working directory while a
# snapshot is replayed (``sources_relative_to``), so a line reads the same from wherever the
# analyzer runs; None: the current directory (a checkpoint records none). NB: a process global,
# not a ContextVar: CUDA runs backward in autograd's own threads, which a ContextVar would not reach.
_BASE: list[str | None] = [None]


@contextmanager
def sources_relative_to(directory: str | None) -> Iterator[None]:
    """Show the source lines of the ops run inside relative to `directory` (None: the current one)."""
    before = _BASE[0]
    _BASE[0] = os.path.realpath(directory) if directory else None
    try:
        yield
    finally:
        _BASE[0] = before


def _shown_name(filename: str, base: str | None = None) -> str:
    """Relative to `base` (default: the working directory) when under it, else absolute."""
    try:
        real = os.path.realpath(filename)
        shown = os.path.relpath(real, base or os.getcwd())
    except (ValueError, OSError):
        return filename
    return real if shown.startswith("..") else shown


def source_path(source: str | None) -> str | None:
    """The absolute ``file:line`` of a ``user_source()`` line shown in the current base."""
    if not source or ":" not in source:
        return None
    file, line = source.rsplit(":", 1)
    if not os.path.isabs(file):
        file = os.path.normpath(os.path.join(_BASE[0] or os.getcwd(), file))
    return f"{file}:{line}"


def attach_module_hooks(model: torch.nn.Module, stack: list[str]) -> list:
    """Push/pop each module's dotted path on `stack` around its forward. Returns the handles."""
    handles = []
    for path, module in model.named_modules():
        name = path or "<model>"

        def pre(_mod, _args, name=name):
            stack.append(name)

        def post(_mod, _args, _out, name=name):
            if stack and stack[-1] == name:
                stack.pop()

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, always_call=True))
    return handles


class _ForwardTagMode(TorchFunctionMode):
    """Tag the autograd nodes each forward call creates with its module path and source line.

    Args:
        stats_mode: the run's ``_OpStatsMode`` (holds the module stack; gets the source line).
        emulate_cuda: upcast FP16/BF16 inputs of ``CUDA_FP32_OPS`` to FP32 under CPU autocast,
            as CUDA autocast would. Used when a CUDA snapshot is replayed on CPU.
    """

    def __init__(self, stats_mode, *, emulate_cuda: bool = False):
        super().__init__()
        self.stats_mode = stats_mode
        self.emulate_cuda = emulate_cuda
        self.emulated = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._current_graph_task_id() != -1:
            return func(*args, **kwargs)
        source = user_source()
        stack = self.stats_mode.module_stack
        module = stack[-1] if stack else "<loss_fn>"
        if (self.emulate_cuda and getattr(func, "__name__", None) in CUDA_FP32_OPS
                and torch.is_autocast_enabled("cpu")):
            args, kwargs = tree_map(_upcast, (args, kwargs))
            self.emulated += 1
        self.stats_mode.current_source = source
        try:
            out = func(*args, **kwargs)
        finally:
            self.stats_mode.current_source = None
        if torch.is_grad_enabled():
            _tag_new_nodes(out, (args, kwargs), module, source)
        return out


def _flat(items) -> list:
    """Flatten nested lists/tuples of op arguments (cheaper than pytree for ATen signatures)."""
    out = []
    for a in items:
        if isinstance(a, (list, tuple)):
            out.extend(_flat(a))
        else:
            out.append(a)
    return out


def _upcast(x):
    if isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x


def _tag_new_nodes(out, inputs, module: str, source: str | None) -> None:
    """Tag nodes reachable from `out`'s grad_fns that this call created (stop at the inputs')."""
    flat_out = _flat(out) if isinstance(out, (list, tuple)) else [out]
    roots = [t.grad_fn for t in flat_out if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    if not roots:
        return
    flat_in = _flat(inputs[0]) + _flat(inputs[1].values())
    stop = {id(t.grad_fn) for t in flat_in if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    todo = list(roots)
    while todo:
        node = todo.pop()
        if node is None or id(node) in stop:
            continue
        meta = node.metadata
        if "module" in meta:
            continue
        meta["module"] = module
        meta["source"] = source
        todo.extend(nxt for nxt, _ in node.next_functions)

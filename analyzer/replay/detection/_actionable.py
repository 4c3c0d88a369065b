"""Causes a user can act on: source lines in installed libraries, and batches that cannot make a loss.

``installed_line`` tells a ``file:line`` in an installed library (site-packages, dist-packages,
the standard library, torch) from the user's own code: a guard fix is never offered at such a
line, since nobody edits site-packages. ``batch_fault`` names what is wrong with the batch when
the culprit is the loss's own 0/0: an HF batch whose every label is the ignore index (-100) has
no target tokens, so ``cross_entropy(reduction="sum") / num_items_in_batch`` is 0/0.

Example:
    >>> installed_line(".venv/lib/python3.11/site-packages/transformers/loss/loss_utils.py:47")
    True
    >>> batch_fault({"labels": torch.full((1, 8), -100)}, {"op": "aten.div", "phase": "forward",
    ...                                                    "output_kind": "nan"})  # doctest: +SKIP
    'every label is -100 in the batch entry `labels`: ...'
"""
from __future__ import annotations

import os
import sysconfig
from collections.abc import Mapping

import torch

__all__ = ["installed_line", "library_of", "batch_fault", "BATCH_FAULT_ADVICE"]

_LIB_DIRS = ("site-packages", "dist-packages")
_ROOTS = tuple(os.path.realpath(p) for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "purelib", "platlib")}
               if p)
_TORCH = os.path.realpath(os.path.dirname(torch.__file__))
# The ops a loss's 0/0 comes out of: a sum divided by a count of zero, a mean over nothing.
_LOSS_OPS = ("aten.div", "aten.nll_loss_forward", "aten.nll_loss2d_forward", "aten.mean")
_LABEL_KEYS = ("labels", "label", "targets", "target")
_NLL = ("aten.nll_loss_forward", "aten.nll_loss2d_forward")
IGNORE_INDEX = -100

BATCH_FAULT_ADVICE = "Skip such batches (no target tokens) or fix the masking that set every label to -100."


def _file(source: str) -> str:
    return source.rsplit(":", 1)[0] if ":" in source else source


def installed_line(source: str | None) -> bool:
    """Whether `source` (``file:line``) lies in an installed library rather than the user's code."""
    if not source:
        return False
    path = _file(source)
    if any(part in _LIB_DIRS for part in path.replace("\\", "/").split("/")):
        return True
    real = os.path.realpath(path)
    return real.startswith(_TORCH + os.sep) or any(real.startswith(r + os.sep) for r in _ROOTS)


def library_of(source: str) -> str:
    """The installed package a library line belongs to (``transformers``), or its file name."""
    parts = _file(source).replace("\\", "/").split("/")
    for i, part in enumerate(parts[:-1]):
        if part in _LIB_DIRS:
            return parts[i + 1]
    return parts[-1]


def _leaves(batch, prefix: str = ""):
    if isinstance(batch, torch.Tensor):
        yield prefix, batch
    elif isinstance(batch, Mapping):
        for k, v in batch.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))


def _reads_targets(trace, index: int, depth: int = 6) -> bool:
    """Whether op `index` of `trace` is, or is fed within `depth` ops by, an ``nll_loss`` (which reads the labels)."""
    frontier, seen = [index], set()
    for _ in range(depth):
        nxt = []
        for i in frontier:
            if i is None or i in seen:
                continue
            seen.add(i)
            if trace.records[i].name in _NLL:
                return True
            nxt += [p for _, p in trace.records[i].inputs]
        frontier = nxt
    return False


def batch_fault(batch, culprit: Mapping | None, trace=None) -> str | None:
    """What is wrong with the batch, when the culprit is a forward 0/0 of the loss; None otherwise.

    With the culprit's run `trace`, the culprit must also be (or be fed by) the ``nll_loss`` that
    reads the labels, so a 0/0 elsewhere in a batch without targets is not blamed on them.
    """
    if culprit is None or culprit.get("phase") != "forward" or culprit.get("output_kind") != "nan" \
            or culprit.get("op") not in _LOSS_OPS:
        return None
    if trace is not None and not _reads_targets(trace, culprit["index"]):
        return None
    leaves = dict(_leaves(batch))
    items = leaves.get("num_items_in_batch")
    count = (f" (num_items_in_batch = {float(items):g})" if isinstance(items, torch.Tensor) and items.numel() == 1
             and not items.is_complex() else "")
    for name, t in leaves.items():
        if name.rsplit(".", 1)[-1] not in _LABEL_KEYS or t.is_floating_point() or t.is_complex() or not t.numel():
            continue
        if bool((t == IGNORE_INDEX).all()):
            return (f"every label is {IGNORE_INDEX} in the batch entry `{name}`: this batch has no target tokens"
                    f"{count}, so the loss is 0/0")
        if t.dim() >= 1 and t.shape[-1] > 1 and bool((t[..., 1:] == IGNORE_INDEX).all()):
            return (f"every label after the first position is {IGNORE_INDEX} in the batch entry `{name}` (a causal "
                    f"LM's shift drops the first): this batch has no target tokens{count}, so the loss is 0/0")
    return None

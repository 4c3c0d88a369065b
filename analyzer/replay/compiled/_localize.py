"""Where a compiled-only NaN/Inf lives: compile one module subtree at a time, the rest eager.

The search starts at the compiled module whose compilation alone makes the step non-finite and
walks down: each child is compiled alone (with the options training compiled its ancestor with);
the first child that still makes the step non-finite is searched next. The smallest module found
is the one whose compiled version goes non-finite while each of its children's does not: the
fusion inside it is what eager rounding does not reproduce. Containers that are never called
(``ModuleList``, ``ModuleDict``) are looked through, not compiled.

NB: the kernel inside the module is named by the compiled run of the whole step
(``_kernel_watch``), not by this search.

Example:
    >>> found = localize(ctx, entries, "float16", 65536.0)  # doctest: +SKIP
    >>> found.module, [(t["module"], t["finite"]) for t in found.tried]  # doctest: +SKIP
    ('blocks.1.gate', [('blocks.0', True), ('blocks.1', False), ('blocks.1.gate', False), ('blocks.1.gate.proj', True)])
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ._run import compiled_once
from ..runs._runs import ReplayContext

__all__ = ["Localized", "localize", "MAX_RUNS"]

MAX_RUNS = 24  # compiled runs at most: each compile costs seconds on CPU


@dataclass(frozen=True)
class Localized:
    """The smallest module found, and every compiled run the search made.

    Attributes:
        module: the module path ("" for the whole model); None when no single entry fails alone.
        phase: "forward" (the loss went non-finite) or "backward" (only a gradient did).
        tried: ``{"module", "finite", "error"}`` per compiled run, in order.
        stopped: the search hit ``MAX_RUNS`` before it finished.
    """

    module: str | None
    phase: str | None
    tried: list[dict] = field(default_factory=list)
    stopped: bool = False


def _children(module: torch.nn.Module, path: str) -> Iterator[str]:
    for name, child in module.named_children():
        sub = f"{path}.{name}" if path else name
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            yield from _children(child, sub)  # never called itself: its members are
        else:
            yield sub


def localize(ctx: ReplayContext, entries: Sequence[dict], precision: str, scale: float,
             phase: str, *, same_masks: bool = False) -> Localized:
    """The smallest module whose compiled version alone makes the step non-finite (see the module doc).

    `entries` are the snapshot's compiled modules; the step with all of them compiled is known to
    be non-finite in `phase`. `same_masks`: each run draws eager's random numbers (a step with
    dropout), so that only compilation differs from the eager replay.
    """
    tried: list[dict] = []

    def fails(entry: dict) -> str | None:
        """The phase the step fails in with only `entry` compiled, else None."""
        out = compiled_once(ctx, [entry], precision, scale, same_masks=same_masks)
        t = out.trace
        tried.append({"module": entry["path"], "finite": bool(t is not None and t.finite), "error": out.error})
        if t is None or t.finite:
            return None
        return "forward" if not t.forward_finite else "backward"

    start: dict | None = entries[0]
    if len(entries) > 1:
        start = None
        for e in entries:
            got = fails(e)
            if got is not None:
                start, phase = e, got
                break
        if start is None:  # only together do the compiled modules fail
            return Localized(None, None, tried)
    model = ctx.build_model(precision)
    current = start["path"]
    while True:
        found = None
        for child in _children(model.get_submodule(current), current):
            if len(tried) >= MAX_RUNS:
                return Localized(current, phase, tried, stopped=True)
            got = fails(dict(start, path=child))
            if got is not None:
                found, phase = child, got
                break
        if found is None:
            return Localized(current, phase, tried)
        current = found

"""Probe ``compiled``: a torch.compile'd model's step re-run compiled as training compiled it.

It applies to a snapshot with a ``compile`` entry (format 5: how training compiled the model) and
runs last (``registry.ORDER``), once every other probe has read the eager runs: the work is
``compiled/replay.py`` (``compiled_run``), which compares the compiled step with the eager run of
the same precision and, when they disagree about finiteness, names the compiled module (``_localize``)
and Inductor kernel (``_kernel_watch``) to blame. Its evidence is ``--json``'s ``compiled`` object
(``ReplayResult.compiled``), and what the ``compile_specific`` verdict (``compiled/verdict.py``)
detects itself in and words its summary and advice from.
"""
from __future__ import annotations

from ..verdicts import registry as verdicts
from ..compiled.replay import CompiledRun, compiled_run
from .registry import ProbeInput, probe

__all__ = ["compiled"]


@probe("compiled")
def compiled(inp: ProbeInput) -> CompiledRun | None:
    entry = getattr(inp.snapshot, "compile", None)  # how training torch.compile'd the model; None: eager
    if not entry:
        return None
    # the eager verdict the compiled step is compared with, as the registry refines it (an eager-only
    # failure names it)
    return compiled_run(inp.ctx, entry, inp.runs, verdicts.refine(inp.diagnosis))

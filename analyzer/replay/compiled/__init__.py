"""A compiled model's replay: the failing precision re-run as training compiled it, against the eager replay.

``replay.compiled_run`` runs it (the module doc there says how the two are compared) for the
``compiled`` probe (``probes/compiled.py``);
``_run.compiled_once`` is one compiled run of the step, ``_kernel_watch`` watches Inductor's
kernels for the first non-finite output, ``_localize`` finds the smallest module whose compiled
version alone fails; ``verdict`` registers ``compile_specific`` and ``fix`` the fix
``compile_disable``. How a model's compiled names map back to its own (``_orig_mod.``) is
``analyzer.replay.runs._compiled``, which the runs use for every model.
"""
from __future__ import annotations

from .replay import NOT_REPRODUCED, CompiledRun, compiled_run

__all__ = ["NOT_REPRODUCED", "CompiledRun", "compiled_run"]

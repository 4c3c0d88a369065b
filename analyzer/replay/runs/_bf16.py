"""BF16 run on demand: the replay runs BF16 when its advice would recommend switching to it.

A replay runs FP32 and the run's low precision (plus ``--dtypes``). Advice to switch FP16 to BF16
(``AdviceLine.fixes`` holding ``bf16``) is kept only when BF16's own replay of the step is finite
(``verdicts.respect_runs``), so when no BF16 run was asked for and the advice names it, the replay
makes that one run instead of printing the line as untested: at loss scale 1, as BF16 trains
without a GradScaler (the ``bf16`` fix judges the switch the same way, and reuses this run). It
costs one forward and backward in BF16, only for the verdicts whose advice names BF16
(``overflow``, ``underflow``, ``loss_scale_overflow``...).

It is one more precision run, not a probe: its trace joins the runs (``--json``'s ``runs``, the
``bf16`` fix's reference), its finiteness joins ``Diagnosis.tried`` and its first NaN/Inf joins
``Diagnosis.origins``, all of which the advice and the fixes read as runs; and whether it is needed
depends on the advice of the verdict as refined, which is worded after the probes have run.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..verdicts import registry as verdicts
from ..detection._origin import find_origin

if TYPE_CHECKING:
    from ..result.trace import RunTrace
    from ..result.diagnosis import Diagnosis

__all__ = ["needs_bf16", "with_bf16"]


def needs_bf16(d: Diagnosis, runs: dict[str, RunTrace]) -> bool:
    """The verdict's advice recommends BF16, and no BF16 run was made."""
    return "bfloat16" not in runs and any("bf16" in a.fixes for a in verdicts.advice(d))


def with_bf16(d: Diagnosis, runs: dict[str, RunTrace], at_one: dict[str, RunTrace]) -> Diagnosis:
    """`d` with the BF16 run among the runs its advice respects, and that run's origin."""
    run = at_one.get("bfloat16") if "bfloat16" in at_one and not at_one["bfloat16"].finite else runs["bfloat16"]
    return dataclasses.replace(d, tried={p: r.finite for p, r in runs.items()},
                               origins={**d.origins, "bfloat16": find_origin(run)})

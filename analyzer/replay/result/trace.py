"""``RunTrace``: what one precision run of a replayed step measured, on the host (a plain value).

``_runs.run_once`` makes it; detection, the probes, the fixes and the plot read it. It lives apart
from the code that produces it so that its readers need not import the runner.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..runs._mode import _OpRecord

__all__ = ["RunTrace", "LOW_PRECISION"]

LOW_PRECISION = ("float16", "bfloat16")


@dataclass
class RunTrace:
    """What one precision run measured, on the host."""

    precision: str              # "float32" | "float16" | "bfloat16"
    scale: float                # loss scale of this run's backward
    records: list[_OpRecord]
    absmax: list[float]         # per statistic; NaN/inf when the tensor held NaN/inf
    nonzero: list[float]        # per zero statistic (empty unless zeros=True)
    loss: float
    loss_dtype: str
    loss_producer: int | None   # op index that produced the loss tensor
    grads_finite: bool
    grad_absmax: float | None   # of the unscaled gradients (divided by `scale`)
    backward_ran: bool
    emulated_cuda_ops: int = 0
    captured: tuple[Any, Any] | None = None
    buffers_read: set[str] | None = None  # of the watched buffers, those the step reads (None: none watched)
    # Per op, where its non-finite output came from (``_origin.op_roots``): worked out once, by the
    # origin analysis, for every trace a ``ReplayResult`` carries; the plot reads it.
    roots: list | None = field(default=None, repr=False, compare=False)
    sdpa_calls: list = field(default_factory=list, repr=False)  # backends.SdpaCall per SDPA call
    micro_starts: list[int] | None = None  # accumulation: the first op index of each micro-batch (_accumulate)
    # Per parameter name, its gradient as the run left it (still multiplied by `scale`): the tensors
    # themselves, no copy (the next run of the rebuilt model makes new ones); ``_compare`` reads them.
    grads: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def forward_finite(self) -> bool:
        return math.isfinite(self.loss)

    @property
    def finite(self) -> bool:
        return self.forward_finite and self.grads_finite

    def kind(self, stat: int) -> int:
        """0 finite, 1 inf, 2 NaN, for a statistic index."""
        v = self.absmax[stat]
        return 2 if math.isnan(v) else (1 if math.isinf(v) else 0)

    def zero_count(self, rec: _OpRecord) -> int | None:
        """Exact zeros in `rec`'s output; None unless this run was recorded with zero counts."""
        if not rec.zeros or not self.nonzero:
            return None
        return int(sum(numel - self.nonzero[i] for i, numel in rec.zeros))

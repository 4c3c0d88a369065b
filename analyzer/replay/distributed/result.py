"""``DistributedResult``: what a distributed replay found, as rank 0 prints it (text and ``--json``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...findings import json_safe
from ..verdicts._advice import advice_with_status
from ..fixes.registry import Fix
from ..result.replay_result import ReplayResult

__all__ = ["DistributedResult", "DTYPE_MAX"]

DTYPE_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38}


def _g(v: float | None) -> str:
    if v is None:
        return "?"
    return str(v) if isinstance(v, float) and not math.isfinite(v) else f"{v:.4g}"


@dataclass(frozen=True)
class DistributedResult:
    """The ranks' agreed answer.

    Attributes:
        verdict: one of ``agree.DISTRIBUTED_VERDICTS``, or with an ``answer`` its verdict (any of the
            one-process replay's).
        culprit: the agreed op (earliest in the step, then lowest rank), with ``rank``; a collective's
            has ``collective``: each rank's input and output abs-max.
        runs: per precision, per rank: ``loss``, ``forward_finite``, ``grads_finite``, ``grad_absmax``,
            ``collectives`` (how many times each collective op ran on that rank).
        world_size / recorded_world_size: the replay's rank count and the run's.
        nonfinite_inputs: parameters (their shards), buffers and batch entries already NaN/Inf, with
            ``input_ranks``: which ranks held them.
        fixes: the fixes tried on every rank.
        notes: what differs from the recorded step (fewer ranks, an older snapshot's layout).
        answer: a NaN/Inf born in an ordinary op: the one-process replay's answer for the culprit rank's
            snapshot, reached by every rank in lockstep (``lockstep.classify``); its verdict, summary,
            culprit and advice are this result's. None: the distributed verdict stands alone.
        culprit_rank: the rank the agreed culprit ran on.
        ddp: a DDP snapshot's ``ddp`` entry (how its gradients were all-reduced); None for FSDP2.
    """

    verdict: str
    culprit: dict[str, Any] | None
    runs: dict[str, list[dict[str, Any]]]
    snapshot: str
    step: int | None
    reason: str | None
    world_size: int
    recorded_world_size: int
    precision_mode: str
    precision_dtype: str | None
    device: str
    nonfinite_inputs: list[str] = field(default_factory=list)
    input_ranks: dict[str, list[int]] = field(default_factory=dict)
    fixes: list[Fix] = field(default_factory=list)
    notes: tuple[str, ...] = ()
    answer: ReplayResult | None = None
    culprit_rank: int | None = None
    ddp: dict[str, Any] | None = None  # a DDP snapshot's ddp entry (recorders.schema.DDP_KEYS); None: FSDP2

    @property
    def summary(self) -> str:
        """One or two sentences, each resting on the numbers in ``culprit`` and ``runs``."""
        if self.answer is not None:
            return f"{self.answer.summary} (rank {self.culprit_rank}'s step.)"
        c = self.culprit
        if self.verdict == "healthy":
            return ("Every rank ran the step's forward and backward without a NaN/Inf in every replayed precision, "
                    "collectives included.")
        if c is None:
            return "; ".join(self.notes) or f"verdict {self.verdict}, with no op to blame"
        where = f"{c['op']} in `{c['module']}` ({c['phase']}) on rank {c['rank']}"
        if self.verdict == "nonfinite_input":
            ranks = self.input_ranks.get(c.get("input"), [])
            return (f"{c.get('input')} (rank(s) {ranks}) was already NaN/Inf before the first op ran; "
                    f"the step itself is not the cause. First read by {where}.")
        if self.verdict == "numerical_bug":
            return f"{where} produced NaN/Inf in FP32 too: not a precision problem."
        coll = c.get("collective")
        if self.verdict == "overflow" and coll is not None and self.ddp is not None:
            return self._ddp_overflow(c, coll)
        if self.verdict == "overflow" and coll is not None:
            dtype = coll.get("reduce_dtype")
            ins = ", ".join(f"rank {r['rank']} {_g(r['input_absmax'])}" for r in coll["ranks"])
            outs = ", ".join(f"rank {r['rank']} {_g(r['output_absmax'])}" for r in coll["ranks"])
            ref = coll.get("fp32_output_absmax")
            group = coll.get("group")
            whose = "the ranks' values" if not group or len(group) >= len(coll["ranks"]) else \
                f"the values of ranks {', '.join(map(str, group))} (its process group)"
            return (f"{c['op']} ({c['phase']}, module `{c['module']}`) summed {whose} in {dtype}: every "
                    f"rank's input was finite (abs-max {ins}) and the reduced value is not (abs-max {outs}; "
                    f"{dtype} max {_g(DTYPE_MAX.get(dtype))}); the FP32 run's same reduction reached {_g(ref)}.")
        if self.verdict == "overflow":
            return (f"{where} produced {_g(c['output_absmax'])} in {c['precision']} from finite inputs (abs-max "
                    f"{_g(c['input_absmax'])}); the FP32 run is finite.")
        return f"{where} is the first op with a NaN/Inf in {c['precision']}, not classified further (see the note)."

    def _ddp_overflow(self, c: dict, coll: dict) -> str:
        """A DDP all-reduce that overflowed: which ranks' gradients the hook's cast already made inf."""
        dtype, hook = coll.get("reduce_dtype"), self.ddp.get("comm_hook") or "DDP's reducer"
        top = DTYPE_MAX.get(dtype, math.inf)
        ins = ", ".join(f"rank {r['rank']} {_g(r['input_absmax'])}" for r in coll["ranks"])
        outs = ", ".join(f"rank {r['rank']} {_g(r['output_absmax'])}" for r in coll["ranks"])
        over = [r["rank"] for r in coll["ranks"] if r["input_absmax"] is not None and r["input_absmax"] > top]
        how = (f"rank(s) {over}'s gradient is beyond {dtype}'s max {_g(top)}, so the hook's cast to {dtype} made "
               f"it inf before the sum" if over else f"the sum left {dtype}'s range (max {_g(top)})")
        return (f"{c['op']} ({c['phase']}, parameter `{c['module']}`) all-reduced the ranks' gradients in {dtype} "
                f"({hook}: each divided by the world size, then summed): every rank's gradient was finite (abs-max "
                f"{ins}) and the reduced value is not (abs-max {outs}): {how}; the FP32 run's same reduction "
                f"reached {_g(coll.get('fp32_output_absmax'))}.")

    @property
    def advice(self) -> list[str]:
        """What to change, each line with the status of the fix that stands for it."""
        if self.answer is not None:
            return [f"[{a.status}] {a.text}" for a in advice_with_status(self.answer, self.fixes)]
        lines = []
        for fix in self.fixes:
            if fix.name == "reduce_fp32" and self.ddp is not None:
                lines.append(f"[{fix.status}] All-reduce the gradients in FP32: register no "
                             f"{self.ddp.get('comm_hook')} (DDP's own all-reduce, or default_hooks.allreduce_hook). "
                             f"{fix.detail}")
            elif fix.name == "reduce_fp32":
                lines.append(f"[{fix.status}] Reduce gradients in FP32: MixedPrecisionPolicy(..., "
                             f"reduce_dtype=torch.float32) at every fully_shard. {fix.detail}")
        if self.verdict == "nonfinite_input":
            lines.append("The weights or the batch were broken before this step: look at the step before it "
                         "(analyzer report RUN), not at this step's ops.")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """``--json``: the distributed fields; with an ``answer``, its culprit (plus ``rank``) and under
        ``replay`` the one-process result's own fields (its runs: the culprit rank's)."""
        if self.answer is not None:
            one = self.answer.to_dict()
            return dict(self._dict(), culprit=dict(one["culprit"] or {}, rank=self.culprit_rank), replay=one)
        return self._dict()

    def _dict(self) -> dict[str, Any]:
        return json_safe({
            "verdict": self.verdict, "summary": self.summary, "culprit": self.culprit, "runs": self.runs,
            "advice": self.advice, "fixes": [f.to_dict() for f in self.fixes],
            "snapshot": self.snapshot, "step": self.step, "reason": self.reason, "device": self.device,
            "precision_mode": self.precision_mode, "precision_dtype": self.precision_dtype,
            "nonfinite_inputs": self.nonfinite_inputs,
            "distributed": {"world_size": self.world_size, "recorded_world_size": self.recorded_world_size,
                            "input_ranks": self.input_ranks, "notes": list(self.notes), "ddp": self.ddp},
        })

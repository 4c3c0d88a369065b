"""The one-process replay's detection, probes, verdicts and fixes, run on every rank in lockstep.

Once the ranks agree that a NaN/Inf was born in an ordinary op (rank R, op i; ``agree.decide``), every
rank runs the one-process pipeline on its own ``ShardedContext``: ``replay._replay`` (detection, the
probes, the verdict registry, summary and advice) and then ``fixes.run_fixes`` (every registered fix
that serves the verdict, with its own hooks). Each run that pipeline asks for is made on every rank,
collectives included, and every rank is handed back rank R's trace of it (``Follow.finish``): R's ops,
statistics and captured inputs, with the loss and gradients' finiteness merged over every rank. So every
rank takes the same decisions and makes the same runs with the same hooks (FSDP2's ranks run the same ops
in the same order, so an op index names the same op on each), and rank R's pipeline gives the answer
the one-process replay of R's snapshot gives.

A culprit born in a collective (a reduction that overflowed in ``reduce_dtype``) goes through the same
registry (``fix_reduction``): ``run_fixes`` plans the fixes that act on a collective (``FixSpec.acts_on``:
``reduce_fp32``), never those that hook a model's op, and runs each on every rank, each rank its own run.

A fix is judged on each rank by the one-process rule (``_reference.judge``: finite and within
``TOLERANCE`` of that rank's own FP32 run of the step, its gradient shards included), then the ranks agree
on its status: the worst any rank reached (``agree_fixes``).

Example (on every rank, after ``decide`` named rank 1's ``aten.log``):
    >>> answer, fixes = classify(ctx, group, 1, path, snap, None)          # doctest: +SKIP
    >>> answer.verdict, [(f.name, f.status) for f in fixes]                 # doctest: +SKIP
    ('numerical_bug', [('guard_clamp', 'verified'), ('guard_eps', 'verified'), ('fp32', 'fails')])
"""
from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass

from ...errors import AnalyzerError
from ...load import Snapshot, recorded_cwd
from ..runs._attribution import sources_relative_to
from ..runs._setup import autocast_was_off, float_or_none
from ..fixes.registry import Fix, run_fixes
from ..result.replay_result import ReplayResult
from ..result.trace import RunTrace
from .agree import UNINITIALISED
from .group import DistGroup
from .sharded import ShardedContext

__all__ = ["Follow", "classify", "fix_reduction", "agree_fixes"]

_FSDP_NAMESPACES = ("fsdp",)
# Worst last: the status the ranks agree on is the highest any rank reached.
_SEVERITY = {"verified": 0, "changes_result": 1, "not_tried": 2, "fails": 3}


def _diverged(leader: int, what: str) -> AnalyzerError:
    return AnalyzerError(f"the ranks' replays of the step diverged ({what}), so rank {leader}'s ops cannot stand for "
                         "every rank's"[:300],
                         fix=f"replay rank {leader}'s snapshot in one process: "
                             f"analyzer replay SNAPSHOT --rank {leader}")


@dataclass
class Follow:
    """A ``ShardedContext``'s lockstep state: every run begins and ends with the ranks agreeing.

    Attributes:
        group: the replay's process group.
        leader: the culprit's rank, whose traces every rank continues with.
        runs: runs finished so far.
    """

    group: DistGroup
    leader: int
    runs: int = 0

    def begin(self, precision: str | None) -> None:
        """Before a run's model is built: every rank is about to make the same run."""
        tags = self.group.agree((self.runs, precision))
        if any(t != tags[0] for t in tags):
            raise _diverged(self.leader, f"run {self.runs}: {sorted(set(map(repr, tags)))[:2]}")

    def finish(self, trace: RunTrace, fsdp_ops: set[int]) -> RunTrace:
        """Rank `leader`'s `trace` of the run every rank just made, with every rank's finiteness merged in.

        The loss stays this rank's own while every rank's is finite (a fix is judged against this rank's FP32
        run), else it is the leader's (or the first rank's) non-finite one; ``grads_finite`` holds when every
        rank's gradient shards are finite; ``grads`` stay this rank's shards.
        """
        self.runs += 1
        names = zlib.crc32("\n".join(r.name for r in trace.records).encode())
        every = self.group.agree((trace.loss, trace.grads_finite, trace.grad_absmax, len(trace.records), names))
        if any(e[3:] != every[self.leader][3:] for e in every):
            counts = ", ".join(f"rank {r} {e[3]}" for r, e in enumerate(every))
            raise _diverged(self.leader, f"the ranks ran different ops in run {self.runs}: {counts} ops")
        mine = _without_garbage(trace, fsdp_ops) if self.group.rank == self.leader else None
        shared: RunTrace = self.group.share(mine, self.leader)
        losses = [e[0] for e in every]
        if all(math.isfinite(v) for v in losses):
            loss = trace.loss
        else:
            loss = shared.loss if not math.isfinite(shared.loss) else next(v for v in losses if not math.isfinite(v))
        grad_max = [e[2] for e in every if e[2] is not None]
        worst = (math.nan if any(math.isnan(v) for v in grad_max) else max(grad_max)) if grad_max else None
        return dataclasses.replace(shared, loss=loss, grads_finite=all(e[1] for e in every), grad_absmax=worst,
                                   grads=trace.grads)


def _without_garbage(trace: RunTrace, fsdp_ops: set[int]) -> RunTrace:
    """`trace` without its gradients, where FSDP2's buffers read as 0 until the step's values are in them.

    NB: ``aten.empty`` holds whatever the memory held, NaN included, and FSDP2's copies of it carry that
    until FSDP2 fills the buffer through a view the dispatch mode does not see as a write: no value of the
    step. An FSDP2 op (its namespace, or an op its hooks ran) that makes NaN/Inf from finite inputs is such a
    copy; its output is read as 0, so no later analysis calls it a hidden NaN/Inf.
    """
    absmax = list(trace.absmax)

    def bad(s: int) -> bool:
        return not math.isfinite(absmax[s])

    for rec in trace.records:
        fsdp = rec.name in UNINITIALISED or rec.namespace in _FSDP_NAMESPACES or rec.index in fsdp_ops
        if fsdp and any(bad(s) for s in rec.outputs) and not any(bad(s) for s, _ in rec.inputs):
            for s in rec.outputs:
                absmax[s] = 0.0
    return dataclasses.replace(trace, absmax=absmax, grads=None)


def classify(ctx: ShardedContext, group: DistGroup, leader: int, path: str, snap: Snapshot, dtypes: list[str] | None,
             fixes: bool = True) -> tuple[ReplayResult, list[Fix]]:
    """The one-process answer for rank `leader`'s snapshot and the fixes every rank agreed on.

    `path`, `snap`: this rank's snapshot; the leader's are shared, so every rank's pipeline reads the same
    recorded facts (reason, loss, scaler) while replaying its own batch and shards.

    NB: collective: every rank calls it, with the same `leader`.
    """
    from ..replay import _replay  # NB: the one-process replay's own pipeline, not a copy of it

    lpath, lsnap = group.share((path, snap) if group.rank == leader else None, leader)
    autocast_off = autocast_was_off(lpath) if lsnap.amp_dtype is not None else None
    ctx.follow = Follow(group, leader)
    try:
        with sources_relative_to(recorded_cwd(lsnap)):
            result = _replay(lpath, lsnap, ctx, dtypes, False, autocast_off)
            tried = run_fixes(result, lambda: ctx) if fixes else []
    finally:
        ctx.follow = None
    agreed = agree_fixes(group, tried, leader)
    answer: ReplayResult = group.share(result if group.rank == leader else None, leader)
    return answer, agreed


@dataclass(frozen=True)
class _ReductionResult:
    """What ``run_fixes`` and a fix's judgement (``_reference.judge``) read of a step whose culprit is a collective:
    the agreed verdict and culprit, and this rank's FP32 run (the reference)."""

    verdict: str
    culprit: dict
    scale: float
    traces: dict[str, RunTrace]
    step: int | None
    snapshot: str
    recorded_loss: float | None


def fix_reduction(ctx: ShardedContext, group: DistGroup, verdict: str, culprit: dict, scale: float, fp32: RunTrace,
                  path: str, snap: Snapshot) -> list[Fix]:
    """The registry's fixes for a culprit born in a collective, tried on every rank, the status every rank agreed on.

    `fp32`: this rank's FP32 run of the step, which each rank judges its own fixed run against; `path`,
    `snap`: this rank's snapshot (its recorded loss, the fallback reference).

    NB: collective: every rank calls it with the same `verdict` and `culprit` (``agree.decide``'s).
    """
    result = _ReductionResult(verdict, culprit, scale, {"float32": fp32}, snap.step, path, float_or_none(snap.loss))
    return agree_fixes(group, run_fixes(result, lambda: ctx), culprit["rank"])


def agree_fixes(group: DistGroup, tried: list[Fix], leader: int) -> list[Fix]:
    """Each fix's status as every rank agrees: the worst any rank reached, its detail naming that rank."""
    every = group.agree(tried)
    names = [[f.name for f in fs] for fs in every]
    if any(n != names[leader] for n in names):
        raise _diverged(leader, f"the ranks tried different fixes: {names}")
    out = []
    for k, fix in enumerate(every[leader]):
        statuses = [fs[k].status for fs in every]
        worst = max(range(len(every)), key=lambda r: (_SEVERITY[statuses[r]], r == leader))
        chosen = every[worst][k]
        if len(set(statuses)) == 1:
            note = f" ({chosen.status} on each of the {len(every)} ranks)"
        else:
            note = " (" + ", ".join(f"rank {r} {s}" for r, s in enumerate(statuses)) + ")"
        prefix = "" if worst == leader else f"on rank {worst}: "
        out.append(dataclasses.replace(chosen, detail=prefix + chosen.detail + note))
    return out

"""``distributed_replay``: a sharded snapshot's step replayed on N processes under torchrun, collectives included.

A DDP snapshot (format 9, its ``ddp`` entry) runs the same phases on a ``replicated.ReplicatedContext``: whole
weights from each rank's own file, DDP's all-reduce as the recorded communication hook does it, in Python,
under the dispatch mode; its fix is the all-reduce in FP32.

Every rank, in lockstep:

1. loads its own snapshot file of the step (its batch, RNG, references) and the DCP directory's metadata,
   rebuilds the model from the factory, applies ``fully_shard`` where training did and loads only its
   shards (``sharded.ShardedContext``); its non-finite shards and batch entries are listed;
2. replays the step in FP32 (no mixed-precision policy: the reference) and in the recorded policy, each
   under the dispatch mode, FSDP2's all-gathers and reduce-scatters included;
3. all-gathers a small summary of each run (``agree.summarize``) and reaches the same verdict from them
   (``agree.decide``);
4. when the culprit is a reduction that overflowed in ``reduce_dtype``, tries the registry's fixes that act on a
   collective (``fixes.run_fixes``; ``reduce_fp32``: the step again with ``reduce_dtype=float32``) on every rank,
   each rank judging its run against its own FP32 run, and the ranks agree on each fix's status
   (``lockstep.fix_reduction``);
5. when the culprit is an ordinary op (rank R, op i), runs the one-process replay's detection, probes,
   verdicts and fixes on every rank in lockstep, following rank R's traces (``lockstep.classify``): the
   verdict, summary, evidence and fixes are those the one-process replay gives for R's snapshot, each
   fix's status the worst any rank reached.

Each phase ends in one all-gather in which a failing rank sends its error: every rank then stops with the
lowest failing rank's error (``group.DistGroup.agree``). Only rank 0 returns the result.

Example (under ``torchrun --nproc-per-node 2 -m analyzer replay SNAPSHOT``):
    >>> result = distributed_replay("run/snapshots/step00000000-r00000-nonfinite_grads.pt")  # doctest: +SKIP
    >>> result.verdict, result.culprit["op"]                                                   # doctest: +SKIP
    ('overflow', 'c10d._reduce_scatter_base_')

An HSDP snapshot (a 2-D replicate x shard mesh) replays on the recorded R x S ranks on that mesh
(``mesh.hsdp_mesh``): each gradient reduce-scattered in its shard group, then all-reduced across the replicas
(``c10d.allreduce_``), both ops of the step like any other.
"""
from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from ...errors import AnalyzerError, BadInputError
from ...load import load_snapshot, snapshot_roots
from ...load.dcp import dcp_directory, read_dcp_metadata, sibling_snapshot
from ..runs._precision import PrecisionMode, precision_mode
from ..runs._runs import ReplayContext, run_once
from ..runs._setup import _bad_leaves, amp_dtype, autocast_was_off, context, loss_scale, precisions
from ..fixes.registry import FIXES, culprit_kind
from .agree import decide, summarize
from .group import DistGroup
from .lockstep import classify, fix_reduction
from .mesh import hsdp_mesh
from .result import DistributedResult
from .replicated import ReplicatedContext, ddp_entry_of
from .sharded import CollectiveFailed, ShardedContext, bad_shards, sharded_layout

__all__ = ["distributed_replay"]

# The agreed verdicts of a culprit born in an ordinary op, which the one-process pipeline then classifies
CLASSIFIED = ("numerical_bug", "overflow", "not_classified")


def distributed_replay(path: str | os.PathLike, *, device: str = "auto", dtypes: list[str] | None = None,
                       factory: str | None = None, loss_fn: str | None = None, paths: tuple[str, ...] = (),
                       fixes: bool = True, on_error: Callable[[AnalyzerError], None] | None = None
                       ) -> DistributedResult | None:
    """Replay the sharded snapshot `path` on this launch's ranks; rank 0 gets the result, others None.

    `on_error` is called on rank 0 with the error every rank stops on, before any rank leaves the group:
    torchrun stops every process once one exits with an error, so rank 0 reports it while its peers wait.

    Raises:
        AnalyzerError: on every rank, the lowest failing rank's error (a bad snapshot, a rank count the
            snapshot cannot serve, a peer that died or timed out).
    """
    with DistGroup(device) as group:
        try:
            return _replay(os.fspath(path), group, device, dtypes, factory, loss_fn, paths, fixes)
        except AnalyzerError as e:  # the model code's error, unless a collective inside it failed
            lost = _collective_failure(e)
            error: AnalyzerError = e if lost is None else group.broken(lost)
        except RuntimeError as e:  # a collective inside a run failed: a peer died, or the timeout ran out
            error = group.broken(e)
        if group.rank == 0 and on_error is not None:
            on_error(error)
        group.settle()  # the others wait until rank 0 has reported (a broken group: not at all)
        raise error


def _replay(path, group: DistGroup, device, dtypes, factory, loss_fn, paths, fixes) -> DistributedResult | None:
    loaded = _phase(group, lambda: _prepare(path, group, device, factory, loss_fn, paths))
    ctx, scale, notes, recorded_world = loaded["ctx"], loaded["scale"], loaded["notes"], loaded["world"]
    bad = group.agree(loaded["bad"])  # every rank's non-finite shards and batch entries
    wanted = _phase(group, lambda: precisions(ctx.mode.dtype, dtypes))
    summaries: dict[str, list[dict]] = {}
    fp32 = None  # this rank's FP32 run: what a fix of a collective's culprit is judged against
    for p in wanted:
        trace = run_once(ctx, p, scale)  # NB: collective: FSDP2's all-gathers and reduce-scatters
        summaries[p] = group.agree(summarize(trace, ctx.collective_modules(), ctx.fsdp_ops(), ctx.collective_sources(),
                                             ctx.collective_groups()))
        if p == "float32":
            fp32 = dataclasses.replace(trace, grads=None, captured=None)
    inputs, input_ranks = _inputs(bad)
    decision = decide(summaries, ctx.mode.dtype, inputs)
    tried, answer = [], None
    if fixes and decision.verdict in CLASSIFIED and culprit_kind(decision.culprit) == "collective":
        # a reduction that left reduce_dtype's range: the registry's fixes that act on a collective, every rank
        tried = fix_reduction(ctx, group, decision.verdict, decision.culprit, scale, fp32, *loaded["mine"])
    if fixes and decision.verdict == "nonfinite_input":  # nothing to run: the registry's check_input names the input
        tried.append(FIXES["check_input"].apply(None, _Inputs(tuple(inputs))))
    if decision.verdict in CLASSIFIED and decision.culprit is not None and culprit_kind(decision.culprit) == "op":
        # a NaN/Inf born in the model's own op: the one-process replay's answer, every rank in lockstep
        answer, tried = classify(ctx, group, decision.culprit["rank"], *loaded["mine"], dtypes, fixes)
    if group.rank != 0:
        return None
    snap = loaded["snap"]  # the snapshot the command named (rank 0 replays its own rank's file of that step)
    runs = {p: [dict({k: s[k] for k in ("loss", "forward_finite", "grads_finite", "grad_absmax")},
                     collectives=dict(Counter(c["op"] for c in s["collectives"]))) for s in ss]
            for p, ss in summaries.items()}
    return DistributedResult(
        verdict=decision.verdict if answer is None else answer.verdict, culprit=decision.culprit, runs=runs,
        snapshot=path, step=snap.step,
        reason=snap.reason, world_size=group.world_size, recorded_world_size=recorded_world,
        precision_mode=_mode_name(ctx), precision_dtype=_compute_dtype(ctx), device=str(group.device),
        nonfinite_inputs=inputs, input_ranks=input_ranks, fixes=tried,
        notes=tuple(notes) + (decision.notes if answer is None else ()), answer=answer,
        ddp=ctx.ddp if isinstance(ctx, ReplicatedContext) else None,
        culprit_rank=None if decision.culprit is None else decision.culprit.get("rank"))


def _mode_name(ctx: ShardedContext) -> str:
    """The precision mode's name; ``reduce_only``: a DDP run that computed in FP32 and reduced in low precision."""
    if isinstance(ctx, ReplicatedContext) and ctx.mode.kind == "parameters" and not ctx.mode.low_names:
        return "reduce_only"
    return ctx.mode.kind


def _compute_dtype(ctx: ShardedContext) -> str | None:
    return None if _mode_name(ctx) == "reduce_only" else ctx.mode.dtype


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What ``check_input`` reads of a result: the inputs already NaN/Inf before the step."""

    nonfinite_inputs: tuple[str, ...]


def _collective_failure(e: BaseException) -> BaseException | None:
    """The failed collective (torch.distributed's ``DistError``) behind `e`, if any: a peer that died or timed out."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (torch.distributed.DistError, CollectiveFailed)):
            return e
        e = e.__cause__ or e.__context__
    return None


def _phase(group: DistGroup, fn):
    """Run `fn` on this rank, then agree: every rank gets its value back, or every rank raises the first error."""
    try:
        value, error = fn(), None
    except AnalyzerError as e:
        value, error = None, e
    group.agree(None, error)
    return value


def _prepare(path: str, group: DistGroup, device: str, factory, loss_fn, paths) -> dict[str, Any]:
    """This rank's snapshot, context and shards; what it found broken before the step."""
    first = load_snapshot(path)
    fsdp = first.fsdp
    world = fsdp.get("world_size") if isinstance(fsdp, dict) else None
    if not isinstance(world, int) and first.ddp is not None:
        return _prepare_ddp(path, first, group, factory, loss_fn, paths)
    if not isinstance(world, int):
        raise BadInputError("neither a sharded (FSDP2) nor a DDP snapshot: the distributed replay needs one (a "
                            "one-process run, or a DDP run recorded before format 9, does not say how its gradients "
                            "were reduced)", path=path,
                            fix="replay it in one process: analyzer replay SNAPSHOT (--rank R for another rank's), "
                                "without torchrun")
    hsdp = hsdp_mesh(path, fsdp.get("mesh"), group.world_size)
    mine, snap = _own_snapshot(path, first, group, world, "(or fewer: the weights are resharded)")
    d = dcp_directory(mine, snap)
    md = read_dcp_metadata(d)
    amp = amp_dtype(mine, snap, autocast_was_off(mine))
    base = context(mine, snap, "cpu", factory, loss_fn, snapshot_roots(snap, paths), state={})
    modules, layout_note = sharded_layout(mine, snap.fsdp)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ReplayContext) if f.init}
    fields.update(device=group.device, mode=dataclasses.replace(precision_mode(mine, snap, amp, {}), sharded=True))
    ctx = ShardedContext(**fields, dcp_dir=d, metadata=md, modules=modules, mesh=hsdp)
    with torch.random.fork_rng(devices=[group.device.index or 0] if group.device.type == "cuda" else []):
        model = ctx.build_model()
        bad = [f"{n}" for n in bad_shards(model)] + [f"batch:{k}" for k, _ in _bad_leaves(ctx.batch, "")]
    ctx._model = None
    notes = [layout_note] if layout_note else []
    notes += _fewer_ranks(world, group.world_size, "DCP resharded the weights, ", "batches", "the reductions sum")
    return {"ctx": ctx, "scale": loss_scale(mine, snap), "notes": notes, "world": world, "snap": first, "bad": bad,
            "mine": (mine, snap)}


def _fewer_ranks(world: int, n: int, resharded: str, left: str, reduction: str) -> list[str]:
    """The note of a replay on fewer ranks than the run recorded (none otherwise): whose batches it leaves out and
    how many ranks' gradients its reductions take."""
    if n >= world:
        return []
    return [f"recorded on {world} ranks, replayed on {n}: {resharded}rank r replays recorded rank r's batch, ranks "
            f"{n}..{world - 1}'s {left + ' ' if left else ''}are left out, and {reduction} {n} ranks' gradients "
            f"instead of {world}"]


def _own_snapshot(path: str, first, group: DistGroup, world: int, fewer: str) -> tuple[str, Any]:
    """This rank's snapshot file of the step and its contents; more ranks than the run recorded is refused."""
    if group.world_size > world:
        raise BadInputError(f"the run was recorded on {world} ranks and this replay has {group.world_size}: ranks "
                            f"{world}..{group.world_size - 1} have no recorded batch to replay", path=path,
                            fix=f"launch with --nproc-per-node {world} {fewer}")
    mine = path if first.rank == group.rank else os.fspath(sibling_snapshot(path, group.rank))
    return mine, (first if mine == path else load_snapshot(mine))


def _prepare_ddp(path: str, first, group: DistGroup, factory, loss_fn, paths) -> dict[str, Any]:
    """A DDP snapshot: every rank loads its own snapshot file of the step (whole weights, its batch)."""
    ddp = ddp_entry_of(path, first.ddp)
    world = ddp.get("world_size") or first.world_size
    mine, snap = _own_snapshot(path, first, group, world, "(or fewer)")
    amp = amp_dtype(mine, snap, autocast_was_off(mine))
    base = context(mine, snap, "cpu", factory, loss_fn, snapshot_roots(snap, paths))
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ReplayContext) if f.init}
    mode = precision_mode(mine, snap, amp, {})
    if mode.dtype is None and ddp.get("reduce_dtype") is not None:
        # FP32 training under a compress hook: the low-precision run computes in FP32 and reduces as recorded
        mode = PrecisionMode(kind="parameters", dtype=ddp["reduce_dtype"])
    fields.update(device=group.device, mode=mode)
    ctx = ReplicatedContext(**fields, ddp=ddp)
    bad = [f"param:{n}" for n, t in ctx.model_state.items()
           if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())]
    bad += [f"batch:{k}" for k, _ in _bad_leaves(ctx.batch, "")]
    notes = _fewer_ranks(world, group.world_size, "", "", "the all-reduce averages")
    return {"ctx": ctx, "scale": loss_scale(mine, snap), "notes": notes, "world": world, "snap": first, "bad": bad,
            "mine": (mine, snap)}


def _inputs(bad: list[list[str]]) -> tuple[list[str], dict[str, list[int]]]:
    ranks: dict[str, list[int]] = {}
    for rank, names in enumerate(bad):
        for n in names:
            ranks.setdefault(n, []).append(rank)
    return list(ranks), ranks

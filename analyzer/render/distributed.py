"""Text of a distributed replay (``torchrun ... -m analyzer replay``), as rank 0 prints it."""
from __future__ import annotations

import dataclasses
import math

from ..replay.distributed import DistributedResult
from .replay import render_replay_text

__all__ = ["render_distributed_text"]


def _g(v) -> str:
    if v is None:
        return "-"
    return str(v) if isinstance(v, float) and not math.isfinite(v) else f"{v:.4g}"


def render_distributed_text(r: DistributedResult) -> str:
    """The verdict, the agreed culprit with every rank's evidence, each run per rank, the fixes tried.

    A culprit the one-process pipeline classified (``r.answer``) is shown as ``analyzer replay`` shows it
    (its advice replaced by the advice after the fixes every rank tried), then every rank's runs.
    """
    if r.answer is not None:
        return _classified(r)
    how = (f"precision mode {r.precision_mode} ({r.precision_dtype or 'float32'})" if r.ddp is None else
           f"DDP, gradients all-reduced as {r.ddp.get('comm_hook') or 'its reducer'} does "
           f"(in {r.ddp.get('reduce_dtype') or 'their own dtype'}), compute {r.precision_dtype or 'float32'}"
           + (" (autocast)" if r.precision_mode == "autocast" and r.precision_dtype else ""))
    lines = [f"verdict: {r.verdict}", f"  {r.summary}",
             f"snapshot: {r.snapshot} (step {r.step}, {r.reason})",
             f"replayed on {r.world_size} rank(s) (recorded on {r.recorded_world_size}), {r.device}, "
             f"{how}, collectives included"]
    lines += [f"  note: {n}" for n in r.notes]
    c = r.culprit
    if c is not None:
        lines += ["", "culprit:", f"  op        {c['op']}", f"  module    {c['module']}", f"  phase     {c['phase']}",
                  f"  rank      {c['rank']}   op #{c['index']}   precision {c['precision']}",
                  f"  inputs    {', '.join(c['input_dtypes']) or '-'}  abs-max {_g(c['input_absmax'])}",
                  f"  output    {c['output_dtype'] or '-'}  abs-max {_g(c['output_absmax'])}"]
        if c.get("input"):
            lines.append(f"  bad input {c['input']} (rank(s) {r.input_ranks.get(c['input'], [])})")
        coll = c.get("collective")
        if coll is not None:
            ref = _g(coll.get("fp32_output_absmax"))
            group = coll.get("group")
            within = f"; the culprit's group: ranks {', '.join(map(str, group))}" \
                if group and len(group) < len(coll["ranks"]) else ""
            lines.append(f"  per rank  (reduced in {coll.get('reduce_dtype')}; FP32 run: {ref}{within})")
            lines += [f"    rank {x['rank']}: input abs-max {_g(x['input_absmax'])}  reduced abs-max "
                      f"{_g(x['output_absmax'])}" for x in coll["ranks"]]
    lines += _rank_runs(r, "runs:")
    if r.fixes:
        lines += ["", "fixes tried on every rank:"]
        lines += [f"  [{f.status}] {f.title}: {f.detail}" for f in r.fixes]
    if r.advice:
        lines += ["", "advice:"] + [f"  - {a}" for a in r.advice]
    return "\n".join(lines)


def _classified(r: DistributedResult) -> str:
    text = render_replay_text(dataclasses.replace(r.answer, advice_lines=()))
    lines = [text, "", f"distributed: replayed on {r.world_size} rank(s) (recorded on {r.recorded_world_size}), "
                       f"{r.device}, collectives included; the culprit ran on rank {r.culprit_rank}, whose step "
                       "is shown above"]
    lines += [f"  note: {n}" for n in r.notes]
    lines += _rank_runs(r, "runs per rank:")
    if r.fixes:
        lines += ["", "fixes tried on every rank:"] + [f"  [{f.status}] {f.title}: {f.detail}" for f in r.fixes]
    if r.advice:
        lines += ["", "advice:"] + [f"  - {a}" for a in r.advice]
    return "\n".join(lines)


def _rank_runs(r: DistributedResult, title: str) -> list[str]:
    lines = ["", title]
    for p, ranks in r.runs.items():
        for rank, s in enumerate(ranks):
            state = "finite" if s["forward_finite"] and s["grads_finite"] else (
                "forward NaN/Inf" if not s["forward_finite"] else "gradients NaN/Inf")
            lines.append(f"  {p:<9} rank {rank}  loss {_g(s['loss']):>10}  {state}")
    return lines

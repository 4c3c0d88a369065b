"""Multi-rank check: ``rank_divergence``.

Under DDP each rank computes its own forward on its own batch; the gradients are averaged, so
one rank's NaN reaches every rank one step later. The rank whose *local* loss went non-finite
first is the one whose batch to replay. The loss scale must be identical on every rank (the
found-inf flag is all-reduced); if it differs, the ranks' scalers are not synchronised.

Findings (all with check ``rank_divergence``):

- error: one rank's loss went non-finite before the others (names the rank and step);
- info: all ranks went non-finite at the same step (a shared cause: weights, learning rate);
- error: the loss scale differs across ranks at some step;
- warning: a rank's trace ends earlier than the others' (it died or was killed first);
- error (FSDP2 runs): a parameter's weights went non-finite in some ranks' shards only. Under
  ``fully_shard`` each rank owns one piece of the weights and every forward all-gathers them,
  so every rank's loss goes bad at the same step: only the shard statistics say whose piece
  broke (its optimizer step on its shard, or a write into it), and that rank's snapshot is the
  one to replay.

``repeated_rank_failure`` (warning): a minority of ranks had a non-finite loss at two or more steps
while every other rank had none (or at most a quarter as many). A fault that follows a rank, not
the model: its hardware (a GPU with silent data corruption, a bad memory page), its host, or its
data shard. When every failing rank is on one host of several (meta.json's ``host``), the host is
named. Real output (four ranks, rank 2 fed a NaN sample at three steps)::

    repeated_rank_failure @ step 5 (rank 2): rank 2 had a non-finite loss at 3 steps (5, 11, 17) while
    the other 3 ranks had none: the fault follows that rank (its GPU or memory, its host node-b, or its
    data shard), not the model. Replay its snapshots on another device (analyzer replay SNAPSHOT
    --device ...) and compare with the other ranks'; check its data shard
"""
from __future__ import annotations

import polars as pl

from ...findings import Finding
from .frames import Frames

__all__ = ["rank_divergence", "repeated_rank_failure"]

MIN_REPEATS = 2  # non-finite loss steps that make a rank's failures repeated
QUIET_SHARE = 4  # the other ranks' count at most 1/QUIET_SHARE of the failing ranks'


def _nonfinite(frames: Frames) -> list[Finding]:
    r = frames.ranks
    bad = r.filter(pl.col("first_nonfinite_step").is_not_null()).sort("first_nonfinite_step", "rank")
    if bad.height == 0:
        return []
    first = int(bad["first_nonfinite_step"][0])
    at_first = bad.filter(pl.col("first_nonfinite_step") == first)["rank"].to_list()
    per_rank = {int(k): (None if v is None else int(v))
                for k, v in zip(r["rank"].to_list(), r["first_nonfinite_step"].to_list())}
    ev = {"first_step": first, "first_ranks": at_first, "first_nonfinite_step_per_rank": per_rank}
    if len(at_first) == r.height:
        return [Finding("rank_divergence", "info", first,
                        f"all {r.height} ranks went non-finite at the same step {first}: the cause is shared "
                        "(weights, learning rate, scaler), not one rank's batch", ev)]
    others = {k: v for k, v in per_rank.items() if k not in at_first}
    later = sorted({v for v in others.values() if v is not None})
    never = [k for k, v in others.items() if v is None]
    parts = []
    if later:
        parts.append(f"the others followed at step {later[0]}" + (f"..{later[-1]}" if len(later) > 1 else ""))
    if never:
        parts.append(f"rank(s) {', '.join(map(str, never[:8]))} stayed finite")
    who = ", ".join(map(str, at_first))
    return [Finding("rank_divergence", "error", first,
                    f"rank {who} had the first non-finite loss, at step {first}; {'; '.join(parts)}: "
                    f"replay rank {at_first[0]}'s snapshot of step {first} (its local batch)", ev,
                    rank=at_first[0] if len(at_first) == 1 else None)]


def _scale(frames: Frames) -> list[Finding]:
    s = frames.steps
    if "scale_max" not in s.columns:
        return []
    div = s.filter(pl.col("scale").is_not_null()
                   & (pl.col("scale_max") > pl.col("scale") * (1 + 1e-6)))
    if div.height == 0:
        return []
    row = div.row(0, named=True)
    ev = {"first_step": int(row["step"]), "steps_diverged": div.height,
          "min_scale": row["scale"], "max_scale": row["scale_max"]}
    return [Finding("rank_divergence", "error", int(row["step"]),
                    f"the loss scale diverged across ranks at step {row['step']} ({row['scale']:g} vs "
                    f"{row['scale_max']:g}, {div.height} step(s) in all): the ranks' GradScalers are not "
                    "synchronised (found_inf not all-reduced: parameters outside DDP, or per-rank scalers)", ev)]


def _ends(frames: Frames) -> list[Finding]:
    r = frames.ranks
    last = int(r["last_step"].max())
    short = r.filter(pl.col("last_step") < last)
    if short.height == 0:
        return []
    ev = {"last_step": last, "short_ranks": dict(zip(short["rank"].to_list(), short["last_step"].to_list()))}
    row = short.sort("last_step").row(0, named=True)
    return [Finding("rank_divergence", "warning", int(row["last_step"]),
                    f"{short.height} rank(s) stop early: rank {row['rank']}'s trace ends at step {row['last_step']}, "
                    f"the others' at {last} (it died or was killed first, or lost unflushed steps)", ev,
                    rank=int(row["rank"]))]


def _shards(frames: Frames) -> list[Finding]:
    """FSDP2: the first step whose weight shards went non-finite on some ranks but not all."""
    sf = frames.shard_faults
    if sf is None:
        return []
    bad = sf.filter(pl.col("weights_bad"))
    if bad.height == 0:
        return []
    step = int(bad["step"].min())
    at = sf.filter(pl.col("step") == step)
    per = at.group_by("layer").agg(bad=pl.col("rank").filter(pl.col("weights_bad")).sort(),
                                   all=pl.col("rank").sort()).sort("layer")
    partial = per.filter((pl.col("bad").list.len() > 0) & (pl.col("bad").list.len() < pl.col("all").list.len()))
    if partial.height == 0:
        return []
    rows = partial.rows(named=True)
    ranks = sorted({r for row in rows for r in row["bad"]})
    params = [frames.param_name(int(row["layer"])) for row in rows]
    ev = {"step": step, "params": params[:20], "ranks": ranks,
          "shards": {frames.param_name(int(row["layer"])): {"nonfinite_ranks": row["bad"], "ranks": row["all"]}
                     for row in rows[:20]}}
    who = ", ".join(map(str, ranks))
    shown = ", ".join(params[:4]) + (f" and {len(params) - 4} more" if len(params) > 4 else "")
    others = sorted(set(rows[0]["all"]) - set(rows[0]["bad"]))
    return [Finding("rank_divergence", "error", step,
                    f"the weights of {shown} went non-finite at step {step} in rank {who}'s shard only (rank(s) "
                    f"{', '.join(map(str, others))} held finite pieces): under FSDP each rank owns its piece and "
                    "every forward all-gathers it, so every rank's loss fails together, but the fault is in rank "
                    f"{who}'s copy of the weights (its optimizer step on its shard, or a write into it), not in a "
                    f"batch: replay rank {ranks[0]}'s snapshot of step {step}", ev,
                    rank=ranks[0] if len(ranks) == 1 else None)]


def rank_divergence(frames: Frames) -> list[Finding]:
    """Which rank went non-finite first; loss-scale divergence; ranks whose trace ends early;
    under FSDP2, whose weight shard went non-finite."""
    if frames.rank is not None or frames.n_ranks < 2:
        return []
    return _shards(frames) + _nonfinite(frames) + _scale(frames) + _ends(frames)


def _hosts(frames: Frames) -> dict[int, str]:
    return {int(rank): meta["host"] for rank, meta in (frames.metas or {}).items()
            if isinstance(meta, dict) and isinstance(meta.get("host"), str)}


def _listed(values, most: int = 8) -> str:
    shown = ", ".join(map(str, values[:most]))
    return shown + (f" and {len(values) - most} more" if len(values) > most else "")


def repeated_rank_failure(frames: Frames) -> list[Finding]:
    """A minority of ranks (or one host's) with non-finite losses at several steps while the others have none."""
    if frames.rank is not None or frames.n_ranks < 2:
        return []
    r = frames.ranks
    counts = {int(k): int(v or 0) for k, v in zip(r["rank"].to_list(), r["n_nonfinite"].to_list())}
    bad = sorted(k for k, v in counts.items() if v >= MIN_REPEATS)
    if not bad or 2 * len(bad) > len(counts):
        return []
    rest = max((v for k, v in counts.items() if k not in bad), default=0)
    if rest * QUIET_SHARE > min(counts[k] for k in bad):
        return []
    steps = frames.steps.filter(pl.col("nonfinite_ranks") > 0)["step"].to_list() if rest == 0 else []
    hosts = _hosts(frames)
    bad_hosts = {hosts.get(k) for k in bad}
    host = next(iter(bad_hosts)) if len(bad_hosts) == 1 and None not in bad_hosts \
        and len(set(hosts.values())) > 1 else None
    n_other = len(counts) - len(bad)
    others = (f"the other {n_other} rank{'s' if n_other > 1 else ''} had none" if rest == 0 else
              f"no other rank had more than {rest}")
    at = f" ({_listed(steps)})" if steps else ""
    if len(bad) == 1:
        who = f"rank {bad[0]} had a non-finite loss at {counts[bad[0]]} steps{at}"
        what = f"that rank (its GPU or memory{f', its host {host}' if host else ''}, or its data shard)"
    else:
        who = f"ranks {_listed(bad)} had non-finite losses at {', '.join(str(counts[k]) for k in bad)} steps{at}"
        what = (f"host {host}, where they run (its GPUs, memory or interconnect), or their data shards" if host
                else "those ranks (their GPUs or memory, or their data shards)")
    first = min(frames.ranks.filter(pl.col("rank").is_in(bad))["first_nonfinite_step"].drop_nulls().to_list(),
                default=None)
    ev = {"ranks": bad, "nonfinite_steps_per_rank": counts, "steps": steps[:20], "host": host,
          "hosts": {k: hosts[k] for k in bad if k in hosts}}
    their = "its" if len(bad) == 1 else "their"
    msg = (f"{who} while {others}: the fault follows {what}, not the model. Replay {their} "
           "snapshots on another device (analyzer replay SNAPSHOT --device ...) and compare with the other ranks'; "
           "check the data shard")
    return [Finding("repeated_rank_failure", "warning", first, msg, ev, rank=bad[0] if len(bad) == 1 else None)]

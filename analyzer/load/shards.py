"""FSDP2 runs: merge each rank's shard statistics into whole-parameter rows of the layer table.

Under ``fully_shard`` every rank records its own shard of each parameter (``recorders._fsdp``):
the layer trace has one row per (step, rank, parameter) that describes a piece of it. Checks
must see whole parameters, so the pieces are combined exactly where the statistic allows:

- ``grad_norm``, ``param_norm``: the square root of the sum of the squared shard norms (in
  float64: squares of float32 norms overflow);
- ``grad_nonfinite``: the sum;
- ``grad_zero_frac`` and any other per-element fraction: the mean weighted by the shards'
  element counts (``local_numel`` in each rank's meta ``params``; empty shards weigh nothing);
- ``update_rms`` (an RMS): the square root of the numel-weighted mean of the squares.

A (step, parameter) group with fewer rows than ranks (a rank killed before it flushed) would
be a piece passed off as the whole: it is left out. Runs of DDP ranks, each of which holds
the whole parameter, are never merged (their meta has no ``fsdp`` entry).

Example:
    >>> table = shard_table(run.metas, run.meta, run.path)      # doctest: +SKIP
    >>> merged = merge_shards(run.layers, table, world_size=2)  # doctest: +SKIP
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl

from recorders import schema

from ..errors import BadInputError

__all__ = ["shard_table", "merge_shards"]

_FIX = "the run's meta files are damaged; restore them from the training hosts or re-record the run"
_SUMMED = ("grad_nonfinite",)
_NORMS = ("grad_norm", "param_norm")
_RMS = ("update_rms",)


def shard_table(metas: dict[int, dict[str, Any]], meta: dict[str, Any], path: Path) -> pl.DataFrame | None:
    """(rank, layer, local_numel) of every sharded parameter, or None when the run is not sharded.

    Raises BadInputError when a rank's meta gives a shard size that is not an integer between 0
    and the parameter's element count.
    """
    if not isinstance(meta.get("fsdp"), dict):
        return None
    ranks, layers, numels = [], [], []
    for rank, m in metas.items():
        for i, p in enumerate(m.get("params") or []):
            if not isinstance(p, dict) or not p.get("sharded"):
                continue
            n, whole = p.get("local_numel"), p.get("numel")
            if not isinstance(n, int) or isinstance(n, bool) or n < 0 or (isinstance(whole, int) and n > whole):
                raise BadInputError(f"rank {rank}'s meta params[{i}] local_numel {n!r} is not a shard size "
                                    f"between 0 and {whole!r}"[:300], path=path / schema.meta_name(rank), fix=_FIX)
            ranks.append(rank)
            layers.append(i)
            numels.append(n)
    if not ranks:
        return None
    return pl.DataFrame({"rank": ranks, "layer": layers, "local_numel": numels},
                        schema={"rank": pl.Int32, "layer": pl.Int32, "local_numel": pl.Int64})


def merge_shards(layers: pl.LazyFrame, table: pl.DataFrame, world_size: int) -> pl.LazyFrame:
    """Whole-parameter rows (the layer table's columns) from the shard rows of `world_size` ranks.

    ``rank`` of a merged row is the lowest rank whose shard holds a non-finite gradient or weight
    (where the fault sits), else null. Parameters that are not sharded (ignored by FSDP) are
    whole on every rank: their rows are taken from the lowest rank, not summed.
    """
    cols = layers.collect_schema()
    n = pl.col("local_numel")
    w = pl.when(n > 0).then(n.cast(pl.Float64))  # empty shards (uneven splits) weigh nothing
    j = layers.join(table.lazy(), on=["rank", "layer"], how="left")
    sharded = j.filter(n.is_not_null())
    whole = (j.filter(n.is_null()).sort("rank").group_by("step", "layer", maintain_order=True).first()
             .drop("local_numel"))

    bad = pl.lit(False)
    if "grad_nonfinite" in cols:
        bad = bad | (pl.col("grad_nonfinite").fill_null(0) > 0)
    for c in _NORMS:
        if c in cols:
            bad = bad | (pl.col(c).is_not_null() & ~pl.col(c).is_finite())
    aggs = [pl.len().alias("_n"), pl.col("rank").filter(bad).min().alias("rank")]
    for c, dtype in cols.items():
        if c in ("step", "layer", "rank"):
            continue
        x = pl.col(c).cast(pl.Float64)
        if c in _NORMS:
            agg = (x * x).sum().sqrt()
        elif c in _SUMMED:
            agg = pl.col(c).sum()
        elif c in _RMS:
            ok = x.is_not_null() & w.is_not_null()
            total = w.filter(ok).sum()
            agg = pl.when(total > 0).then(((x * x * w).filter(ok).sum() / total).sqrt())
        elif dtype.is_float():  # a per-element fraction: weighted by shard size; NaN/null shards left out
            ok = x.is_finite() & w.is_not_null()
            total = w.filter(ok).sum()
            agg = pl.when(total > 0).then((x * w).filter(ok).sum() / total)  # no element: no fraction
        else:
            agg = pl.col(c).first()
        null = pl.col(c).is_null().all()  # a statistic no shard recorded stays null (no grad: no norm)
        aggs.append(pl.when(null).then(None).otherwise(agg).cast(dtype).alias(c))
    merged = (sharded.group_by("step", "layer").agg(aggs)
              .filter(pl.col("_n") >= world_size).drop("_n"))
    order = list(cols)
    return pl.concat([merged.select(order), whole.select(order)], how="vertical")

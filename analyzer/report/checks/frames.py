"""Frames: the small, collected aggregates of a run that every check and plot reads.

``build_frames(run)`` runs a handful of streaming polars queries over the lazy trace and never
collects the per-layer table itself:

- ``steps``: one row per step (ranks merged: mean loss, min/max scale, any skipped, max norm);
- ``layer_bins``: per (step bin, layer): mean log10 gradient norm (``lg``, zero norms clipped
  to ``LOG_FLOOR``), rows, rows with a finite norm, mean zero fraction and parameter norm, the
  weights' change columns, and for the plots only (``plots=True``) rows with a NaN/Inf norm
  (``n_bad``: a null norm is no gradient, not a bad one); at
  most ~2000 bins, so the size is bounded whatever the run length (100M rows -> 200k);
- ``ranks``: one row per rank (first non-finite loss, skipped count, last step);
- ``fp8`` (format 8): per (rank, FP8 module, operand role), the steps whose casts were measured and those past
  the FP8 limits, with the worst fractions.

In an FSDP2 run each rank's layer rows describe its shard of each parameter: they are merged
into whole-parameter rows first (``analyzer.load.shards``), for every rank selection, so the
checks always see whole parameters; ``shard_faults`` keeps the per-rank view of the first steps
whose shards went non-finite, to name the rank that holds the fault.

Checks are pure functions of a ``Frames``; ``layer_window`` fetches the few layer rows around
one step (e.g. a loss spike) with a filtered scan, ``layer_rows`` the raw rows of a few steps
(which parameters' gradients were non-finite).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from recorders import schema

from ...load import Run, SnapshotInfo, progress_line, snapshot_info
from ...load._tracecheck import READ_ERRORS, quiet_native_stderr
from ...load.shards import merge_shards

__all__ = ["Frames", "build_frames", "fp8_limits", "LOG_FLOOR", "MAX_BINS"]

LOG_FLOOR = 1e-30  # log10 of a zero norm is clipped to -30: "no gradient at all", still plottable
MAX_BINS = 2000
_STREAM = {"engine": "streaming"}


@dataclass
class Frames:
    """Collected aggregates of one run (or one rank of it). See the module docstring."""

    steps: pl.DataFrame
    layer_bins: pl.DataFrame | None
    params: list[str]
    numels: list[int | None]
    amp_dtype: str | None
    growth_interval: int
    ranks: pl.DataFrame
    snapshots: list[SnapshotInfo] = field(default_factory=list)
    bin_width: int = 1
    rank: int | None = None
    source_format: str = "amp-autopsy"
    layer_window: Callable[[int, int], pl.DataFrame] | None = None
    notes: list[str] = field(default_factory=list)
    repeated_rows: int = 0  # step rows that repeat a rank's step number (a reused directory, a resumed run)
    layer_rows: Callable[[int, int], pl.DataFrame] | None = None
    # FSDP2 runs: (step, rank, layer, weights_bad, grads_bad) of every shard at the first step whose
    # shards held non-finite weights and at the first with non-finite gradients; None otherwise
    shard_faults: pl.DataFrame | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # rank 0's meta.json (optimizer, params' dtypes)
    # since format 8: per (rank, FP8 module, operand role), the steps measured and those past the FP8 limits
    # (fp8_casts); None when the run recorded no FP8 casts
    fp8: pl.DataFrame | None = None
    metas: dict[int, dict[str, Any]] = field(default_factory=dict)  # every rank's meta.json (warnings, hosts)
    _derived: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def derived(self, name: str, build: Callable[[Frames], Any]) -> Any:
        """``build(self)``, computed once per Frames under `name`: a value several checks read (the
        stalled bins, the gradient trends). Treat it as read-only: the next reader gets the same object."""
        if name not in self._derived:
            self._derived[name] = build(self)
        return self._derived[name]

    @property
    def n_ranks(self) -> int:
        return self.ranks.height

    def param_name(self, layer: int) -> str:
        return self.params[layer] if 0 <= layer < len(self.params) else f"param[{layer}]"


def _step_filter(steps: tuple[int | None, int | None] | None) -> pl.Expr:
    lo, hi = steps or (None, None)
    expr = pl.lit(True)
    if lo is not None:
        expr &= pl.col("step") >= lo
    if hi is not None:
        expr &= pl.col("step") < hi
    return expr


def _collect(run: Run, queries: list[pl.LazyFrame]) -> list[pl.DataFrame]:
    """Collect `queries` together, streaming (``pl.collect_all``: a scan they share is read once, and
    cached for the slower reader: worth it for the small step table, not for the layer table).

    Load read only the parts' footers: a data page that does not decode fails here, and
    ``run.diagnose`` names the part in one ``BadInputError``. An error it cannot pin on a part
    is re-raised as it is (an internal error).
    """
    try:
        with quiet_native_stderr():  # a decoder panic's backtrace must not precede the Error: line
            return pl.collect_all(queries, **_STREAM)
    except READ_ERRORS:  # polars raises several types for a damaged page (panics are BaseException)
        if run.diagnose is not None:
            run.diagnose()  # raises, naming the part
        raise


def _check_keys(run: Run, nulls: pl.DataFrame) -> None:
    """A null step, rank or layer (counted by the queries that read them) is a damaged part: name it."""
    if run.diagnose is not None and nulls.height and any(nulls.row(0)):
        run.diagnose()


def _merged_steps(run: Run, lf: pl.LazyFrame, n_ranks: int) -> pl.DataFrame:
    extra = [c for c in ("n_iter", "n_skipped") if c in lf.collect_schema().names()]
    if n_ranks == 1:
        out = _collect(run, [lf.with_columns(scale_max=pl.col("scale"), n_ranks=pl.lit(1, pl.UInt32),
                                             nonfinite_ranks=(~pl.col("loss").is_finite()).cast(pl.UInt32))
                             .drop("rank")])[0]
        # parts are read in order, so one rank's steps usually arrive sorted: checked on the collected
        # column (a stable sort of sorted rows is those rows), which spares a sort's copy (~75 MB at 1M steps)
        return out if out["step"].is_sorted() else out.sort("step", maintain_order=True)
    loss = pl.col("loss")
    return _collect(run, [lf.group_by("step").agg(
        wall_time=pl.col("wall_time").max(),
        loss=loss.mean(),  # NaN on any rank makes the merged loss NaN, as it should
        loss_dtype=pl.col("loss_dtype").first(),
        scale=pl.col("scale").min(), scale_max=pl.col("scale").max(),
        skipped=pl.col("skipped").any(), grad_norm=pl.col("grad_norm").max(),
        lr=pl.col("lr").first(), nonfinite_grads=pl.col("nonfinite_grads").sum(),
        n_ranks=pl.len(), nonfinite_ranks=(~loss.is_finite()).sum(),
        *[pl.col(c).sum() for c in extra],
    ).sort("step")])[0]


def _rank_summary(lf: pl.LazyFrame) -> pl.LazyFrame:
    loss = pl.col("loss")
    return (lf.group_by("rank").agg(
        n_steps=pl.len(), first_step=pl.col("step").min(), last_step=pl.col("step").max(),
        first_nonfinite_step=pl.col("step").filter(~loss.is_finite()).min(),
        n_nonfinite=(~loss.is_finite()).sum(),
        n_skipped=pl.col("skipped").sum(),
        min_scale=pl.col("scale").min(),
        final_scale=pl.col("scale").sort_by("step").last(),
    ).sort("rank"))


def _finite(x: pl.Expr) -> pl.Expr:
    """`x` with NaN/Inf as null: ``x + 0 * x`` is NaN exactly there (and `x` itself, sign of zero
    included, elsewhere), and ``fill_nan`` nulls it; measured ~10% cheaper in the layer aggregate
    than ``pl.when(x.is_finite()).then(x)``, with the same values."""
    return (x + 0 * x).fill_nan(None)


def _layer_bins(lf: pl.LazyFrame, s0: int, s1: int, width: int, changes: bool = True,
                plots: bool = True) -> pl.LazyFrame:
    """The per-(bin, layer) aggregate, lazy: ``_finish_bins`` turns its result into ``layer_bins``."""
    # One integer group key (bin << 24 | layer), per-row columns prepared before the group-by and
    # nothing the checks do not read: measured 2.5x faster than grouping on (bin, layer) with
    # filtered aggregations, on 100M rows. A non-finite norm (overflowed step) is left out.
    gn = pl.col("grad_norm")
    fin = gn.is_finite()
    key = (((pl.col("step") - s0) // width) * (1 << 24) + pl.col("layer")).alias("key")
    zf, pn = pl.col("grad_zero_frac"), pl.col("param_norm")  # NaN/Inf there is no value: left out too
    # the weights' own columns (checks/updates.py): non-finite param_norm rows, and since format 3 the
    # change columns; without them (older runs) param_norm's min/max instead (bitwise-equal norms:
    # weights that did not move). NB: one pair or the other, to keep this one scan cheap.
    upd = [c for c in ("update_rms", "unchanged_frac") if changes and c in lf.collect_schema().names()]
    extra = {f"_{c}": _finite(pl.col(c)) for c in upd}
    aggs = ({"urms": pl.col("_update_rms").mean(), "unch": pl.col("_unchanged_frac").mean(),
             "n_upd": pl.col("_unchanged_frac").count()} if len(upd) == 2 else
            {"pn_lo": pl.col("pn").min(), "pn_hi": pl.col("pn").max()})
    if plots:  # the heatmap's NaN/Inf cells; no check reads them
        extra["gbad"] = gn.is_not_null() & ~fin
        aggs["n_bad"] = pl.col("gbad").sum()
    return (lf.select(key, lg=pl.when(fin).then(gn.clip(lower_bound=LOG_FLOOR).log10()),
                      zf=pl.when(fin).then(_finite(zf)), pn=_finite(pn),
                      pbad=(pn.is_not_null() & ~pn.is_finite()), **extra)
            .group_by("key").agg(pl.col("lg").mean(), n=pl.len(), n_grad=pl.col("lg").count(),
                                 zero_frac=pl.col("zf").mean(), pnorm=pl.col("pn").mean(),
                                 pbad=pl.col("pbad").sum(), **aggs))


def _finish_bins(out: pl.DataFrame, s0: int, s1: int, width: int) -> pl.DataFrame:
    bin_ = (pl.col("key") // (1 << 24)).cast(pl.Int32)
    return (out.with_columns(bin=bin_, layer=(pl.col("key") % (1 << 24)).cast(pl.Int32))
            .with_columns(step_lo=s0 + pl.col("bin").cast(pl.Int64) * width,
                          step_hi=pl.min_horizontal(s0 + (pl.col("bin").cast(pl.Int64) + 1) * width - 1, s1))
            .drop("key").sort("bin", "layer"))


def _shard_faults(run: Run, llf: pl.LazyFrame) -> pl.DataFrame | None:
    """Every shard's row at the first step with a non-finite weight shard and at the first with a
    non-finite gradient shard (two small filtered scans); None when every shard stayed finite."""
    pn, gn = pl.col("param_norm"), pl.col("grad_norm")
    bad_w = pn.is_not_null() & ~pn.is_finite()
    bad_g = (pl.col("grad_nonfinite").fill_null(0) > 0) | (gn.is_not_null() & ~gn.is_finite())
    firsts = _collect(run, [llf.select(w=pl.col("step").filter(bad_w).min(), g=pl.col("step").filter(bad_g).min())])[0]
    at = [int(v) for v in firsts.row(0) if v is not None]
    if not at:
        return None
    return _collect(run, [llf.filter(pl.col("step").is_in(at))
                          .select("step", "rank", "layer", weights_bad=bad_w, grads_bad=bad_g.fill_null(False))
                          .sort("step", "layer", "rank")])[0]


def fp8_limits(meta: dict[str, Any]) -> tuple[float, float]:
    """(flushed, saturated) fraction limits of the run's FP8 trigger: meta.json's ``fp8``, else the schema's."""
    got = meta.get("fp8") if isinstance(meta.get("fp8"), dict) else {}
    out = []
    for key, default in (("flush_limit", schema.FP8_FLUSH_LIMIT), ("saturate_limit", schema.FP8_SATURATE_LIMIT)):
        v = got.get(key)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1
        out.append(float(v) if ok else default)
    return out[0], out[1]


def _fp8_casts(run: Run, sel: pl.Expr, rank: int | None) -> pl.DataFrame | None:
    """Per (rank, module, role, use): steps measured; past the limits (``fp8_limits``): steps, first and last, the
    worst fractions and amax. One small group-by over the fp8 parts (a few rows per FP8 module and step)."""
    if run.fp8 is None:
        return None
    flush, sat = fp8_limits(run.meta or {})
    lf = run.fp8.filter(sel & pl.col("step").is_not_null() & pl.col("module").is_not_null() & pl.col("role").is_not_null())
    if rank is not None:
        lf = lf.filter(pl.col("rank") == rank)
    ff = pl.when(pl.col("nonzero") > 0).then(pl.col("flushed") / pl.col("nonzero")).otherwise(0.0)
    sf = pl.when(pl.col("numel") > 0).then(pl.col("saturated") / pl.col("numel")).otherwise(0.0)
    over = pl.col("over")
    out = _collect(run, [lf.with_columns(ff=ff, sf=sf).with_columns(over=(pl.col("ff") > flush) | (pl.col("sf") > sat))
                         .group_by("rank", "module", "role", "use").agg(
        measured=pl.col("step").n_unique(), n_over=pl.col("step").filter(over).n_unique(),
        first=pl.col("step").filter(over).min(), last=pl.col("step").filter(over).max(),
        flushed=pl.col("ff").max(), saturated=pl.col("sf").max(), amax=pl.col("amax").filter(over).max(),
        format=pl.col("format").first(), granularity=pl.col("granularity").first(),
    ).sort("rank", "first", "module", "role", "use", nulls_last=True)])[0]
    return out if out.height else None


def build_frames(run: Run, *, rank: int | None = None, steps=None, progress: bool = False,
                 plots: bool = True) -> Frames:
    """Aggregate `run` (optionally one rank, optionally steps A <= step < B) into Frames.

    `plots=False` leaves out what only the plots read (``layer_bins``' ``n_bad``, the heatmap's
    NaN/Inf cells); the checks read the same frames either way.
    """
    sel = _step_filter(steps)
    all_steps = run.steps.filter(sel)
    progress_line(progress, "summarising ranks")
    queries = [_rank_summary(all_steps), run.steps.select(pl.col("step").null_count(), pl.col("rank").null_count())]
    if run.layers is not None:  # the layer table's null ranks: a scan of its own, run beside these
        queries.append(run.layers.select(pl.col("rank").null_count()))
    # NB: the step table is collected after these. Collected with them, it shares their steps scan,
    # which polars then caches whole for its group-by: 100 ranks x 100k steps took 1.0 GB (not
    # 0.31 GB) and 17% longer, for 0.1 s saved on 1,000 ranks x 200 steps
    ranks, nulls, *rest = _collect(run, queries)
    _check_keys(run, nulls)
    layer_nulls = rest[0] if run.layers is not None else None
    lf = all_steps if rank is None else all_steps.filter(pl.col("rank") == rank)
    n_ranks = ranks.height if rank is None else 1
    notes, repeated = [], 0
    progress_line(progress, "aggregating steps")
    merged = _merged_steps(run, lf, n_ranks)
    rows = int(merged["n_ranks"].sum()) if merged.height else 0
    if merged.height and (merged["step"].diff().min() == 0 or int(merged["n_ranks"].max()) > n_ranks):
        # a reused run directory or a resumed run repeats step numbers; parts are read in order,
        # so keep each rank's latest row of a step (checked on the small merged frame: no extra scan)
        merged = _merged_steps(run, lf.unique(["rank", "step"], keep="last", maintain_order=True), n_ranks)
        repeated = rows - int(merged["n_ranks"].sum())
        notes.append(f"{repeated} step rows repeat a step number: the run "
                     "directory was reused or the run resumed; the latest row of each step is used, "
                     "per-layer statistics mix both")
    layer_bins, width, window, rows, shard_faults = None, 1, None, None, None
    if run.layers is not None and merged.height:
        s0, s1 = int(merged["step"].min()), int(merged["step"].max())
        n_layers = max(1, len(run.params))
        max_bins = max(50, min(MAX_BINS, 4_000_000 // n_layers))
        width = max(1, math.ceil((s1 - s0 + 1) / max_bins))
        llf = run.layers.filter(sel & pl.col("step").is_between(s0, s1))  # no layer rows without a step row
        if run.shards is not None:  # FSDP2: a rank's rows are pieces; whole parameters for any --rank
            shard_faults = _shard_faults(run, llf)
            llf = merge_shards(llf, run.shards, run.world_size)
        elif rank is not None:
            llf = llf.filter(pl.col("rank") == rank)
        progress_line(progress, f"aggregating per-layer gradient norms ({width} step(s) per bin)")
        version = run.meta.get("format_version")  # runs before format 3 have no change columns
        # the bins; with the layer table's null ranks, counted with the step queries, the null keys (a null
        # step or layer is a null key). NB: that count is not collected with the bins: sharing the layer scan
        # makes polars cache it for both, which cost 0.6-0.8 GB more peak memory and ~13% more CPU on 100M rows
        out = _collect(run, [_layer_bins(llf, s0, s1, width, changes=not (isinstance(version, int) and version < 3),
                                         plots=plots)])[0]
        _check_keys(run, layer_nulls.hstack([pl.Series("key", [out["key"].null_count()])]))
        layer_bins = _finish_bins(out, s0, s1, width)
        if layer_bins.height == 0:
            layer_bins = None

        def window(lo: int, hi: int, _llf=llf) -> pl.DataFrame:
            lg = pl.col("grad_norm").clip(lower_bound=LOG_FLOOR).log10()
            return _collect(run, [_llf.filter(pl.col("step").is_between(lo, hi))
                                  .group_by("step", "layer").agg(lg=lg.filter(lg.is_finite()).mean())
                                  .sort("step", "layer")])[0]

        def rows(lo: int, hi: int, _llf=llf) -> pl.DataFrame:
            return _collect(run, [_llf.filter(pl.col("step").is_between(lo, hi))
                                  .select("step", "rank", "layer", "grad_norm", "grad_nonfinite", "param_norm")
                                  .sort("step", "rank", "layer")])[0]

    snaps = [snapshot_info(p) for p in run.snapshots]
    if rank is not None:
        snaps = [s for s in snaps if s.rank in (rank, None)]
    return Frames(steps=merged, layer_bins=layer_bins, params=list(run.params), numels=list(run.numels),
                  amp_dtype=run.amp_dtype, growth_interval=run.growth_interval, ranks=ranks,
                  snapshots=snaps, bin_width=width, rank=rank, source_format=run.source_format,
                  layer_window=window, notes=notes, layer_rows=rows, shard_faults=shard_faults,
                  meta=dict(run.meta or {}), metas=dict(run.metas or {}), repeated_rows=repeated,
                  fp8=_fp8_casts(run, sel, rank))

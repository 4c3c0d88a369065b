"""The run's trace around a spike step: the lr, the gradient norm, the weight norm and the largest update jump.

``trace_context(snapshot_path, step, rank, window)`` reads the run directory beside a snapshot (its steps and
its sampled per-layer rows) over the `window` steps before `step`, and says how the step compares with their
medians. Everything is optional: a run without the rows (a checkpoint replay, ``layer_every`` that skipped
them, a foreign log) gives None for what it lacks; an unreadable run gives None.

Example:
    >>> trace_context("run/snapshots/step00000101-r00000-loss_spike.pt", 101, 0, 100)  # doctest: +SKIP
    TraceContext(lr=3.0, lr_median=0.003, grad_norm_median=0.21, ..., update_layer='0.weight', update_ratio=912.0)
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["TraceContext", "trace_context"]


@dataclass(frozen=True)
class TraceContext:
    """The spike step against the trailing window (None: not in the trace).

    Attributes:
        lr / lr_median: the lr the trace holds for the last step before the spike, and its trailing median.
        grad_norm_median: the trailing median of the total gradient norm.
        weight_norm / weight_norm_median: the total norm of the sampled parameters at the last recorded step
            up to the spike, and its trailing median.
        update_layer / update_ratio / update_step: the layer whose update (``update_rms``) at the last recorded
            step before the spike was the largest multiple of its own trailing median, that multiple, that step.
    """

    lr: float | None = None
    lr_median: float | None = None
    grad_norm_median: float | None = None
    weight_norm: float | None = None
    weight_norm_median: float | None = None
    update_layer: str | None = None
    update_ratio: float | None = None
    update_step: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _median(series) -> float | None:
    vals = series.drop_nulls().drop_nans() if series.len() else series
    vals = vals.filter(vals.is_finite()) if vals.len() else vals
    return float(vals.median()) if vals.len() else None


def trace_context(snapshot_path: str, step: int, rank: int, window: int) -> TraceContext | None:
    """The trace around `step` (see the module doc); None when the run directory cannot be read."""
    import polars as pl

    from ...errors import AnalyzerError
    from ...load import load_run

    try:
        run = load_run(Path(snapshot_path).parent.parent)
        lo = step - window
        steps = (run.steps.filter((pl.col("rank") == rank) & (pl.col("step") >= lo) & (pl.col("step") < step))
                 .sort("step").select("step", "lr", "grad_norm").collect())
        layers = (run.layers.filter((pl.col("rank") == rank) & (pl.col("step") >= lo) & (pl.col("step") <= step))
                  .select("step", "layer", "param_norm", "update_rms").collect())
    except (AnalyzerError, pl.exceptions.PolarsError, OSError, ValueError):
        return None
    out = {}
    if steps.height:
        last = steps["lr"][-1]
        out["lr"] = float(last) if last is not None and math.isfinite(last) else None
        out["lr_median"], out["grad_norm_median"] = _median(steps["lr"]), _median(steps["grad_norm"])
    if layers.height:
        norms = (layers.group_by("step").agg((pl.col("param_norm").cast(pl.Float64) ** 2).sum().sqrt().alias("n"))
                 .sort("step"))
        w = norms["n"][-1]
        out["weight_norm"] = float(w) if w is not None and math.isfinite(w) else None
        out["weight_norm_median"] = _median(norms["n"][:-1]) if norms.height > 1 else None
        out.update(_update_jump(layers.filter(pl.col("step") < step), run.params))
    return TraceContext(**out)


def _update_jump(layers, params: list) -> dict:
    """The layer whose last update_rms is the largest multiple of its own earlier median."""
    import polars as pl

    if not layers.height:
        return {}
    last = int(layers["step"].max())
    before = layers.filter(pl.col("step") < last).group_by("layer").agg(pl.col("update_rms").median().alias("m"))
    now = layers.filter(pl.col("step") == last).join(before, on="layer")
    now = now.filter(pl.col("m") > 0).with_columns((pl.col("update_rms") / pl.col("m")).alias("r"))
    now = now.filter(pl.col("r").is_finite()).sort("r", descending=True)
    if not now.height:
        return {}
    layer = int(now["layer"][0])
    name = params[layer] if 0 <= layer < len(params) else str(layer)
    return {"update_layer": name, "update_ratio": float(now["r"][0]), "update_step": last}

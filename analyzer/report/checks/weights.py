"""Weight growth check: ``weights_exploded`` (one optimizer update multiplied a layer's weights).

The layer trace's ``param_norm`` is taken *before* each step, so ``param_norm`` at step N+1 over
``param_norm`` at step N is what the update of step N did to that parameter. Healthy training
moves a weight by a small fraction per update; a norm multiplied by ``FACTOR`` or more in one
update is a learning rate (or an update rule) far out of range. The forward of the steps after it
then overflows or goes NaN somewhere downstream, so the op a replay blames there is a symptom:
this finding is the cause, and ``analyzer autopsy`` leads with it.

Only parameters whose new norm is at least the median of the layers' norms before the update
count: a zero- or tiny-initialised bias growing into an ordinary size is no explosion.

Real output (``tests/analyzer/report/test_weights.py``: the recorder tests' MLP, SGD at lr=1e5)::

    weights_exploded @ step 0: the update of step 0 multiplied the weights' norm of 10 of 10
    parameter(s) by up to 2.2e+05 (6.bias: 0.204 -> 4.4e+04) at lr 1e+05: the learning rate is far
    too high for this model; lower it (or add warm-up / gradient clipping). Later non-finite losses, ...

How to read it: the step is the update's; later non-finite losses, gradients or overflowing ops
are its consequences. ``lr`` is the trace's lr at that step (the first parameter group's).
"""
from __future__ import annotations

import numpy as np
import polars as pl

from ...findings import Finding
from .frames import Frames

__all__ = ["weights_exploded", "FACTOR"]

FACTOR = 100.0  # one update multiplying a parameter's norm by this much is an explosion


def _candidate_bins(frames: Frames) -> tuple[int, int] | None:
    """The step range of the first pair of bins where some layer's mean param_norm jumped by FACTOR."""
    b = frames.layer_bins
    if b is None or "pnorm" not in b.columns:
        return None
    wide = (b.select("bin", "layer", "pnorm", "step_lo", "step_hi").filter(pl.col("pnorm").is_finite())
            .sort("layer", "bin")
            .with_columns(prev=pl.col("pnorm").shift(1).over("layer"), prev_lo=pl.col("step_lo").shift(1).over("layer"))
            .filter((pl.col("prev") > 0) & (pl.col("pnorm") >= FACTOR ** 0.5 * pl.col("prev"))))
    if wide.height == 0:
        return None
    first = wide.sort("step_lo").row(0, named=True)
    return int(first["prev_lo"]), int(first["step_hi"])


def _jump(rows: pl.DataFrame) -> dict | None:
    """The first update (step) in `rows` that multiplied a parameter's norm by FACTOR, with the layers."""
    pn = (rows.filter(pl.col("param_norm").is_finite()).group_by("step", "layer")
          .agg(pl.col("param_norm").sum()).sort("layer", "step")
          .with_columns(prev=pl.col("param_norm").shift(1).over("layer"),
                        prev_step=pl.col("step").shift(1).over("layer")))
    for step in sorted(set(pn["step"].to_list())):
        at = pn.filter(pl.col("step") == step)
        prev_step = at["prev_step"].max()
        if prev_step is None:
            continue
        before = pn.filter(pl.col("step") == prev_step)
        median = float(np.median(before["param_norm"].to_numpy()))
        hit = at.filter((pl.col("prev") > 0) & (pl.col("param_norm") >= FACTOR * pl.col("prev"))
                        & (pl.col("param_norm") >= median))
        if hit.height:
            return {"update_step": int(hit["prev_step"].min()), "seen_at": step,
                    "layers": hit.with_columns(factor=pl.col("param_norm") / pl.col("prev"))
                    .sort("factor", descending=True), "n_layers": at.height}
    return None


def weights_exploded(frames: Frames) -> list[Finding]:
    """One optimizer update multiplied a parameter's weights' norm by FACTOR or more (see the module doc)."""
    span = _candidate_bins(frames)
    if span is None or frames.layer_rows is None:
        return []
    found = _jump(frames.layer_rows(*span))
    if found is None:
        return []
    layers, step = found["layers"], found["update_step"]
    top = layers.row(0, named=True)
    name = frames.param_name(int(top["layer"]))
    lr_rows = frames.steps.filter(pl.col("step") == step) if "lr" in frames.steps.columns else None
    lr = None
    if lr_rows is not None and lr_rows.height and lr_rows["lr"][0] is not None:
        lr = float(lr_rows["lr"][0])
    ev = {"update_step": step, "factor": float(top["factor"]), "parameter": name,
          "norm_before": float(top["prev"]), "norm_after": float(top["param_norm"]),
          "parameters": [frames.param_name(int(v)) for v in layers["layer"].to_list()],
          "lr": lr, "threshold": FACTOR}
    at_lr = f" at lr {lr:.3g}" if lr is not None else ""
    msg = (f"the update of step {step} multiplied the weights' norm of {layers.height} of {found['n_layers']} "
           f"parameter(s) by up to {ev['factor']:.2g} ({name}: {ev['norm_before']:.3g} -> {ev['norm_after']:.3g})"
           f"{at_lr}: the learning rate is far too high for this model; lower it (or add warm-up / gradient "
           "clipping). Later non-finite losses, gradients or overflowing ops follow from these weights")
    return [Finding("weights_exploded", "error", step, msg, ev)]

"""Trace values no training run writes: ``implausible_trace``, so a damaged or hand-made trace is never analysed in silence.

Real output (a run directory whose steps part was rewritten with negative step numbers)::

    implausible_trace: the trace holds values no training run records: 5 negative step number(s)
    (the least -5); the other findings read these rows as they are
        evidence: negative_steps=5 min_step=-5 ...

How to read it: the recorder writes the step numbers ``begin_step`` was given and the layer ids of
meta.json's ``params``. Negative steps, steps beyond 10**12 (near the int64 limits, where step
arithmetic overflows) or layer ids outside the parameter list mean the files were edited, mixed
from two runs, or damaged; so do layer ids when meta.json lists no parameters at all. A GradScaler's
scale is never negative, and it never trains a step (one not skipped) under a scale of 0 or inf:
unscaling then makes every gradient non-finite (0 x inf) and the step is skipped. meta.json's ``scaler``
holds GradScaler's own settings, which torch checks when it builds one: a ``growth_interval`` that
is not a positive integer, a ``growth_factor`` not above 1 or a ``backoff_factor`` not in (0, 1)
was not written by a training run (the checks then use torch's defaults). Repeated step numbers are
a note of their own (a reused directory or a resumed run). An imported log
(``analyzer.load.logs``) adds the values it could not read as its tool writes them: a cell that is
not a number, a loss scale that is not positive and finite, an iteration count outside its log
interval, a CSV row with more or fewer fields than its header::

    implausible_trace: the trace holds values no training run records: 2 malformed value(s) in the
    lightning_csv log: line 3: loss '\\x003' is not a number; line 4: 4 field(s), the header has 2; ...
"""
from __future__ import annotations

import math

import polars as pl

from ...findings import Finding
from ...load.logs import LOG_PROBLEMS
from .frames import Frames

__all__ = ["implausible_trace", "repeated_steps", "MAX_STEP"]

MAX_STEP = 10**12  # a trillion optimizer steps: beyond any run; int64 arithmetic on steps overflows near 2**63


def implausible_trace(frames: Frames) -> list[Finding]:
    """Negative steps, steps beyond MAX_STEP, layer ids outside meta.json's params: one warning naming them."""
    ev, parts = {}, []
    steps = frames.steps["step"] if frames.steps.height else pl.Series("step", [], pl.Int64)
    neg = int((steps < 0).sum())
    if neg:
        ev.update(negative_steps=neg, min_step=int(steps.min()))
        parts.append(f"{neg} negative step number(s) (the least {int(steps.min())})")
    huge = int((steps.abs() > MAX_STEP).sum()) if steps.len() else 0
    if huge:
        ev.update(huge_steps=huge, max_abs_step=int(steps.abs().max()))
        parts.append(f"{huge} step number(s) beyond {MAX_STEP:.0e} (up to {int(steps.abs().max())}, near the int64 "
                     "limits)")
    n = len(frames.params)
    if frames.layer_bins is not None and n:
        layers = frames.layer_bins["layer"]
        out = layers.filter((layers < 0) | (layers >= n)).unique().sort()
        if out.len():
            ev.update(layers_out_of_range=out.head(8).to_list(), params=n)
            parts.append(f"layer ids outside 0..{n - 1}, the {n} parameters meta.json lists "
                         f"({', '.join(str(v) for v in out.head(8).to_list())}{', ...' if out.len() > 8 else ''})")
    if frames.layer_bins is not None and not n and frames.layer_bins.height:
        layers = frames.layer_bins["layer"]
        ev.update(layers_without_params=int(layers.n_unique()), params=0)
        parts.append(f"layer ids {int(layers.min())}..{int(layers.max())} while meta.json lists no parameters")
    parts += _scale_problems(frames, ev) + _scaler_settings(frames.meta.get("scaler"), ev)
    logged = frames.meta.get(LOG_PROBLEMS) if frames.source_format != "amp-autopsy" else None
    if isinstance(logged, dict) and logged.get("count"):  # written by analyzer.load.logs, never read from a file
        ev.update(log_problems=logged["count"], log_examples=logged["examples"])
        more = f" and {logged['count'] - len(logged['examples'])} more" if logged["count"] > len(logged["examples"]) else ""
        parts.append(f"{logged['count']} malformed value(s) in the {frames.source_format} log: "
                     + "; ".join(logged["examples"]) + more)
    if not parts:
        return []
    msg = ("the trace holds values no training run records: " + "; ".join(parts)
           + "; the other findings read these rows as they are (were the files edited, mixed from two runs or "
           "damaged?)")
    return [Finding("implausible_trace", "warning", None, msg, ev)]


def _scale_problems(frames: Frames, ev: dict) -> list[str]:
    """Steps trained (not skipped) under a loss scale of 0, a negative or a non-finite one."""
    st = frames.steps
    if not st.height or "scale" not in st.columns:
        return []
    scale = pl.col("scale")
    bad = st.filter(scale.is_not_null() & ((scale <= 0) | ~scale.is_finite()) & ~pl.col("skipped").fill_null(False))
    if not bad.height:
        return []
    ev.update(unskipped_bad_scale_steps=bad.height, first_bad_scale_step=int(bad["step"][0]),
              bad_scale=float(bad["scale"][0]))
    return [f"{bad.height} step(s) not skipped under a loss scale of {float(bad['scale'][0]):g} (first at step "
            f"{int(bad['step'][0])}): a GradScaler's scale is never negative, and under a scale of 0 or inf every "
            "unscaled gradient is non-finite, so GradScaler skips the step"]


def _setting_ok(key: str, v) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    if key == "growth_interval":
        return math.isfinite(v) and v == int(v) and 0 < v < 2**31  # GradScaler(growth_interval=2000.0) is a real run
    if not math.isfinite(v):
        return False
    return {"growth_factor": v > 1, "backoff_factor": 0 < v < 1}.get(key, v > 0)


def _scaler_settings(scaler, ev: dict) -> list[str]:
    """meta.json's GradScaler settings that GradScaler itself refuses to be built with."""
    if not isinstance(scaler, dict):
        return []
    bad = {k: scaler[k] for k in ("growth_interval", "growth_factor", "backoff_factor", "init_scale")
           if k in scaler and scaler[k] is not None and not _setting_ok(k, scaler[k])}
    if not bad:
        return []
    ev.update(bad_scaler_settings={k: str(v)[:40] for k, v in bad.items()})
    return ["meta.json's scaler settings " + ", ".join(f"{k} {str(v)[:40]!r}" for k, v in bad.items())
            + " are not GradScaler's (torch's defaults are used: growth_interval 2000)"]


def repeated_steps(frames: Frames) -> list[Finding]:
    """Step rows that repeat a rank's step number: named, as info (a resumed run writes them too)."""
    n = frames.repeated_rows
    if not n:
        return []
    return [Finding("repeated_steps", "info", None,
                    f"{n} step row(s) repeat a step number already recorded for their rank: the run directory was "
                    "reused or the run resumed; the latest row of each step is used, and per-layer statistics mix "
                    "both", {"rows": n})]

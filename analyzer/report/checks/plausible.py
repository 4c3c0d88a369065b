"""Trace values no training run writes: ``implausible_trace``, so a damaged or hand-made trace is never analysed in silence.

Real output (a run directory whose steps part was rewritten with negative step numbers)::

    implausible_trace: the trace holds values no training run records: 5 negative step number(s)
    (the least -5); the other findings read these rows as they are
        evidence: negative_steps=5 min_step=-5 ...

How to read it: the recorder writes the step numbers ``begin_step`` was given and the layer ids of
meta.json's ``params``. Negative steps, steps beyond 10**12 (near the int64 limits, where step
arithmetic overflows) or layer ids outside the parameter list mean the files were edited, mixed
from two runs, or damaged. Repeated step numbers are a note of their own (a reused directory). An imported log
(``analyzer.load.logs``) adds the values it could not read as its tool writes them: a cell that is
not a number, a loss scale that is not positive and finite, an iteration count outside its log
interval, a CSV row with more or fewer fields than its header::

    implausible_trace: the trace holds values no training run records: 2 malformed value(s) in the
    lightning_csv log: line 3: loss '\\x003' is not a number; line 4: 4 field(s), the header has 2; ...
"""
from __future__ import annotations

import polars as pl

from ...findings import Finding
from ...load.logs import LOG_PROBLEMS
from .frames import Frames

__all__ = ["implausible_trace", "MAX_STEP"]

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

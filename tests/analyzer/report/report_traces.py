"""Hypothesis strategies that generate whole run directories for ``analyzer report``.

A generated trace is written exactly as the Recorder writes one: ``meta.json`` with
``schema.META_KEYS`` and Parquet parts from the Recorder's own ``TraceWriter`` (step rows as
dicts, layer rows with ``schema.LAYER_COLUMNS``). Two families:

- ``hostile_traces``: every column may be NaN, +-Inf or null, in patterns (at step 0, at the last
  step, on every step, sprinkled); single-step runs; no scaler or a scale below 1; layer rows
  every N steps, parameters that never get a gradient; ranks of different lengths;
- ``healthy_traces``: a finite, slowly decaying loss with small noise, a steady scaler (or none),
  steady per-layer gradient norms: nothing a check should report.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
from hypothesis import strategies as st

from recorders import schema
from recorders.trace import TraceWriter

from .report_models import make_meta

__all__ = ["TraceSpec", "hostile_traces", "healthy_traces", "write_trace", "every_column"]

_BAD = (float("nan"), float("inf"), float("-inf"), None)
_PATTERNS = ("ok", "first", "last", "all", "sprinkled", "null")


@dataclass
class TraceSpec:
    """Everything needed to write one generated run directory."""

    amp_dtype: str | None
    scaler: bool
    n_layers: int
    layer_every: int
    lengths: list[int]              # steps per rank
    start: int                      # first step number
    seed: int
    patterns: dict[str, str] = field(default_factory=dict)  # column -> pattern
    scale_floor: float = 65536.0    # the lowest scale the scaler falls to
    no_grad_layers: list[int] = field(default_factory=list)  # parameters that never get a gradient
    healthy: bool = False


def _apply(values: list, pattern: str, rng: np.random.Generator, bad, choices=_BAD) -> list:
    n = len(values)
    if pattern == "ok" or n == 0:
        return values
    if pattern == "first":
        values[0] = bad
    elif pattern == "last":
        values[-1] = bad
    elif pattern == "all":
        values = [bad] * n
    elif pattern == "null":
        values = [None] * n
    else:  # sprinkled
        for i in np.flatnonzero(rng.random(n) < 0.3):
            values[int(i)] = choices[int(rng.integers(len(choices)))]
    return values


def _steps_rows(spec: TraceSpec, rank: int, n: int, rng: np.random.Generator) -> list[dict]:
    steps = list(range(spec.start, spec.start + n))
    loss = [float((3 * math.exp(-i / 40) + 1) * rng.lognormal(0, 0.01)) for i in range(n)]
    gn = [float(0.1 * rng.lognormal(0, 0.05)) for _ in range(n)]
    scale = [None] * n
    skipped: list = [None] * n
    if spec.scaler:
        s = 65536.0
        scale, skipped = [], []
        for i in range(n):
            scale.append(s)
            drop = not spec.healthy and s > spec.scale_floor
            skipped.append(drop or (spec.healthy and i == 0))
            s = s / 2 if skipped[-1] else s
    cols = {"loss": loss, "scale": scale, "skipped": skipped, "grad_norm": gn,
            "lr": [1e-3] * n, "wall_time": [1.7e9 + i for i in range(n)],
            "nonfinite_grads": [0] * n, "loss_dtype": ["float32"] * n}
    typed = {"skipped": (True, None), "nonfinite_grads": (3, None), "loss_dtype": ("float16", None),
             "scale": _BAD + (0.0, -1.0, 1e-45)}  # a scale that underflowed to 0, or nonsense
    for c in cols:
        choices = typed.get(c, _BAD)
        bad = choices[int(rng.integers(len(choices)))]
        cols[c] = _apply(cols[c], spec.patterns.get(c, "ok"), rng, bad, choices)
    return [{"step": s, "rank": rank, **{c: v[i] for c, v in cols.items()}} for i, s in enumerate(steps)]


def _layer_frame(spec: TraceSpec, rank: int, steps: list[int], rng: np.random.Generator) -> pl.DataFrame | None:
    L = spec.n_layers
    kept = [s for s in steps if (s - spec.start) % spec.layer_every == 0]
    if not L or not kept:
        return None
    base = rng.normal(-1.5, 0.2, L)
    gnorm = [[float(10 ** (base[j] + rng.normal(0, 0.03))) for j in range(L)] for _ in kept]
    cols: dict[str, list] = {
        "grad_norm": [g for row in gnorm for g in row],
        "param_norm": [float(2 + j) for _ in kept for j in range(L)],
        "grad_nonfinite": [0] * (len(kept) * L),
        "grad_zero_frac": [0.001] * (len(kept) * L),
        "update_rms": [1e-4] * (len(kept) * L),   # version 3 columns: fuzzed like the others
        "unchanged_frac": [0.01] * (len(kept) * L),
    }
    for c in cols:
        choices = (5, None) if c == "grad_nonfinite" else _BAD
        bad = choices[int(rng.integers(len(choices)))]
        cols[c] = _apply(cols[c], spec.patterns.get("layer_" + c, "ok"), rng, bad, choices)
    for i in range(len(kept)):
        for j in spec.no_grad_layers:
            k = i * L + j
            cols["grad_norm"][k] = cols["grad_zero_frac"][k] = cols["grad_nonfinite"][k] = None
    return pl.DataFrame({"step": [s for s in kept for _ in range(L)], "rank": [rank] * (len(kept) * L),
                         "layer": list(range(L)) * len(kept), **cols}, schema=schema.LAYER_COLUMNS)


def write_trace(spec: TraceSpec, run_dir: Path) -> Path:
    """Write `spec` as a run directory (one meta file and up to two parts per rank)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    params = [{"name": f"l{j // 2}.{'weight' if j % 2 == 0 else 'bias'}", "shape": [16], "numel": 16,
               "dtype": "float32", "depth": j} for j in range(spec.n_layers)]
    scaler = ({"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "init_scale": 65536.0}
              if spec.scaler else None)
    world = len(spec.lengths)
    for rank, n in enumerate(spec.lengths):
        rng = np.random.default_rng(spec.seed * 7 + rank)
        meta = make_meta(rank, world, spec.amp_dtype, scaler, params)
        meta["layer_every"] = spec.layer_every
        (run_dir / schema.meta_name(rank)).write_text(json.dumps(meta))
        rows = _steps_rows(spec, rank, n, rng)
        layers = _layer_frame(spec, rank, [r["step"] for r in rows], rng)
        writer = TraceWriter(run_dir, rank)
        cut = max(1, n // 2)
        for lo, hi in ((0, cut), (cut, n)):
            part = rows[lo:hi]
            if not part:
                continue
            steps = {r["step"] for r in part}
            lay = None if layers is None else layers.filter(pl.col("step").is_in(sorted(steps)))
            writer.write(part, lay)
    return run_dir


_COLUMNS = ("loss", "scale", "skipped", "grad_norm", "lr", "wall_time", "nonfinite_grads", "loss_dtype",
            "layer_grad_norm", "layer_param_norm", "layer_grad_nonfinite", "layer_grad_zero_frac",
            "layer_update_rms", "layer_unchanged_frac")


@st.composite
def hostile_traces(draw) -> TraceSpec:
    """Traces with non-finite or missing values anywhere (see the module docstring)."""
    n_ranks = draw(st.integers(1, 3))
    lengths = [draw(st.sampled_from([1, 2, 3, 7, 30, 70])) for _ in range(n_ranks)]
    amp = draw(st.sampled_from(["float16", "bfloat16", None]))
    n_layers = draw(st.sampled_from([0, 1, 2, 6]))
    patterns = {c: draw(st.sampled_from(_PATTERNS)) for c in _COLUMNS}
    return TraceSpec(
        amp_dtype=amp, scaler=draw(st.booleans()), n_layers=n_layers,
        layer_every=draw(st.sampled_from([1, 1, 3])), lengths=lengths,
        start=draw(st.sampled_from([0, 0, 5])), seed=draw(st.integers(0, 10_000)), patterns=patterns,
        scale_floor=draw(st.sampled_from([65536.0, 1024.0, 0.25, 1e-30])),
        no_grad_layers=draw(st.lists(st.integers(0, max(0, n_layers - 1)), max_size=2, unique=True))
        if n_layers else [])


@st.composite
def healthy_traces(draw) -> TraceSpec:
    """Finite, steady traces that no check should flag (errors or warnings)."""
    n_ranks = draw(st.integers(1, 2))
    n = draw(st.sampled_from([1, 2, 10, 60, 120]))
    amp = draw(st.sampled_from(["float16", "bfloat16", None]))
    return TraceSpec(amp_dtype=amp, scaler=amp == "float16" and draw(st.booleans()),
                     n_layers=draw(st.sampled_from([0, 2, 6])), layer_every=draw(st.sampled_from([1, 4])),
                     lengths=[n] * n_ranks, start=draw(st.sampled_from([0, 100])),
                     seed=draw(st.integers(0, 10_000)), healthy=True)


def every_column(pattern: str, *, amp_dtype: str | None = "float16", scaler: bool = True,
                 lengths: tuple[int, ...] = (30,), n_layers: int = 4) -> TraceSpec:
    """One `pattern` ("all", "null", "first", "last", "sprinkled") in every column at once."""
    return TraceSpec(amp_dtype=amp_dtype, scaler=scaler, n_layers=n_layers, layer_every=1, lengths=list(lengths),
                     start=0, seed=1, patterns={c: pattern for c in _COLUMNS}, scale_floor=0.25)

"""What every log importer shares: the synthesised ``Run``, bounded line reading, integer fields
and the generic ``step``/``loss``/``scale``/... row mapping."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import polars as pl

from ...errors import BadInputError
from .._limits import NumberTooLong, json_loads, safe_strings
from .._logcheck import LOG_PROBLEMS, Problems, number_cell
from .._logcheck import to_float as _num
from ..run import Run, step_frame

__all__ = ["HF_TRAINER_STATE", "I64", "LIGHTNING_METRICS", "MAX_LINE", "RUN_HINT", "TFEVENTS_PREFIX", "generic_rows",
           "lines", "read_json", "to_run", "whole"]

HF_TRAINER_STATE = "trainer_state.json"
LIGHTNING_METRICS = "metrics.csv"
TFEVENTS_PREFIX = "events.out.tfevents"
# the fix of every "not a run" error, here and in run_dir
RUN_HINT = (f"pass a run directory written by the amp-autopsy Recorder, or a {HF_TRAINER_STATE}, "
            f"{LIGHTNING_METRICS}, DeepSpeed/Megatron log, CSV or JSONL file")
_LOSS_KEYS = ("loss", "train_loss_step", "train_loss", "train/loss", "loss_step", "training_loss", "lm_loss")
_SCALE_KEYS = ("scale", "loss_scale", "loss scale", "train/loss_scale", "grad_scale")
_GN_KEYS = ("grad_norm", "train/grad_norm", "grad_2.0_norm_total", "total_grad_norm", "gradient_norm")
_LR_KEYS = ("lr", "learning_rate", "train/learning_rate")
I64 = 2**63
MAX_LINE = 16 << 20  # a log line longer than 16 MiB is not a log line


def to_run(path: Path, fmt: str, rows: pl.DataFrame, *, amp_dtype=None, growth_interval=None,
         notes=(), bad: Problems | None = None) -> Run:
    if rows.height == 0:
        raise BadInputError(f"no training steps found in this {fmt} log" + (bad.first() if bad else ""), path=path,
                            fix="pass the log of a run that logged at least one training step")
    steps = step_frame(rows)
    meta = {"format": fmt, "amp_dtype": amp_dtype, "world_size": 1, "params": [],
            "scaler": None if growth_interval is None else {"growth_interval": growth_interval}}
    if bad:  # the implausible_trace check names them: a damaged log is never analysed in silence
        meta[LOG_PROBLEMS] = bad.to_meta()
    return Run(path=path, source_format=fmt, meta=meta, metas={0: meta}, steps=steps.lazy(),
               layers=None, notes=[f"imported from a {fmt} log: no per-layer gradient norms, "
                                   "so stalled/vanishing/underflow checks cannot run", *notes])


def read_json(path: Path) -> Any:
    try:
        return safe_strings(json_loads(path.read_bytes().decode("utf-8")))
    except NumberTooLong as e:
        raise BadInputError(str(e), path=path, fix=RUN_HINT) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInputError(f"not valid JSON ({e})"[:300], path=path, fix=RUN_HINT) from e
    except RecursionError as e:
        raise BadInputError("JSON nested too deeply to read", path=path, fix=RUN_HINT) from e


def lines(path: Path, *, errors: str = "strict"):
    """(number, text) per line, refusing a line over ``MAX_LINE`` bytes instead of reading it all."""
    with path.open("rb") as f:
        for i, raw in enumerate(iter(lambda: f.readline(MAX_LINE + 1), b""), 1):
            if len(raw) > MAX_LINE and not raw.endswith(b"\n"):
                raise BadInputError(f"line {i} is longer than {MAX_LINE >> 20} MiB: not a log", path=path,
                                    fix=RUN_HINT)
            try:
                yield i, raw.decode("utf-8", errors=errors).rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise BadInputError(f"line {i} is not UTF-8 text ({e.reason})", path=path, fix=RUN_HINT) from e


def whole(v, path: Path, what: str, lo: int, hi: int) -> int:
    """An integer field (step, rank, iteration) read from a log, range-checked: a hostile log's
    ``inf``, ``1e400``, 5000-digit or negative rank becomes one error naming the file."""
    x = v if isinstance(v, int) and not isinstance(v, bool) else None
    if x is None:
        f = _num(v)
        if f is not None and math.isfinite(f) and f == int(f):
            x = int(f)
    if x is None or not lo <= x < hi:
        raise BadInputError(f"{what} {str(v)[:40]!r} is not an integer in [{lo}, {hi})", path=path,
                            fix="the log is damaged or foreign; " + RUN_HINT)
    return x


def _first_key(d: dict[str, Any], keys) -> str | None:
    return next((k for k in keys if k in d and not isinstance(d[k], (dict, list)) and d[k] not in (None, "")), None)


def generic_rows(records: list[tuple[str, dict[str, Any]]], path: Path, bad: Problems,
                  loss_keys=_LOSS_KEYS, shape: dict[str, str] | None = None) -> pl.DataFrame:
    """Rows from ``(where, record)`` pairs; a cell of a mapped column that holds no number is named
    in `bad` (``where`` is "line 3" or "log_history[2]"), after the record's `shape` problem if any."""
    rows = []
    for where, r in records:
        if shape and where in shape:
            bad.add(where, shape[where])
        raw_step = r.get("step", r.get("global_step"))
        lk = _first_key(r, loss_keys)
        loss = None if lk is None else number_cell(r[lk], where, lk, bad)
        if number_cell(raw_step, where, "step", bad) is None or loss is None:
            continue  # validation/epoch rows carry no training loss
        step = whole(raw_step, path, "step", -I64, I64)
        rank = 0 if _num(r.get("rank")) is None else whole(r.get("rank"), path, "rank", 0, 2**31)
        gk = _first_key(r, _GN_KEYS) or next((k for k, v in r.items() if isinstance(k, str) and k.startswith("grad_")
                                              and "norm_total" in k and v not in (None, "")), None)
        gn = None if gk is None else number_cell(r[gk], where, gk, bad)
        lrk = _first_key(r, _LR_KEYS) or next((k for k, v in r.items() if isinstance(k, str) and k.startswith("lr-")
                                               and v not in (None, "")), None)
        lr = None if lrk is None else number_cell(r[lrk], where, lrk, bad)
        sk = _first_key(r, _SCALE_KEYS)
        scale = None if sk is None else number_cell(r[sk], where, sk, bad)
        skipped = r.get("skipped")
        if not isinstance(skipped, (bool, int, float, str)):
            skipped = None
        loss_dtype = r.get("loss_dtype")
        rows.append({"step": step, "rank": rank, "loss": loss, "scale": scale, "grad_norm": gn, "lr": lr,
                     "skipped": None if skipped in (None, "") else str(skipped).lower() in ("1", "true", "1.0"),
                     "loss_dtype": loss_dtype[:64] if isinstance(loss_dtype, str) and loss_dtype else None})
    if not rows:
        raise BadInputError(f"no rows with both 'step' and a loss column ({', '.join(_LOSS_KEYS[:4])}, ...)"
                            + bad.first(), path=path,
                            fix="log the training loss with its step, e.g. a 'step,loss' CSV")
    schema_ = {"step": pl.Int64, "rank": pl.Int32, "loss": pl.Float64, "scale": pl.Float64,
               "grad_norm": pl.Float64, "lr": pl.Float64, "skipped": pl.Boolean, "loss_dtype": pl.String}
    return pl.DataFrame(rows, schema=schema_)

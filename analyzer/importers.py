"""Map logs from other tools onto the recorder's step columns, so the same checks run on them.

Supported (detected by file name, then content):

- HF Trainer ``trainer_state.json``: ``log_history`` entries with ``loss``, ``grad_norm``,
  ``learning_rate``, ``step``. NB: HF's ``logging_nan_inf_filter`` (on by default) replaces a
  NaN/Inf loss by the running average before logging; a non-finite ``grad_norm`` next to a
  finite loss is the trace it leaves.
- Lightning ``CSVLogger`` ``metrics.csv``: ``step`` plus a loss column (``train_loss_step``,
  ``train_loss``, ``loss``...), optional ``lr-*`` and ``grad_*norm*`` columns.
- DeepSpeed text logs: ``[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: X,
  reducing to Y``, ``step=N, skipped=K`` and ``steps: N loss: L`` lines.
- Megatron-LM text logs: ``iteration N/ M | ... | lm loss: L | loss scale: S | grad norm: G |
  number of skipped iterations: K | number of nan iterations: J |`` (one line per log interval).
- Generic CSV / JSONL with ``step`` and any of ``loss``, ``scale`` (or ``loss_scale``),
  ``grad_norm``, ``lr``, ``skipped``.
- TensorBoard event directories, when the ``tensorboard`` extra is installed.
"""
from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from typing import Any

import polars as pl

from recorders import schema

from .errors import BadInputError
from .runs import Run, progress_line, step_frame

__all__ = ["import_file", "import_dir"]

_FIX = ("pass a run directory written by the amp-autopsy Recorder, or a trainer_state.json, "
        "metrics.csv, DeepSpeed/Megatron log, CSV or JSONL file")
_LOSS_KEYS = ("loss", "train_loss_step", "train_loss", "train/loss", "loss_step", "training_loss", "lm_loss")
_SCALE_KEYS = ("scale", "loss_scale", "loss scale", "train/loss_scale", "grad_scale")
_GN_KEYS = ("grad_norm", "train/grad_norm", "grad_2.0_norm_total", "total_grad_norm", "gradient_norm")
_LR_KEYS = ("lr", "learning_rate", "train/learning_rate")


def _run(path: Path, fmt: str, rows: pl.DataFrame, *, amp_dtype=None, growth_interval=None,
         notes=()) -> Run:
    if rows.height == 0:
        raise BadInputError(f"no training steps found in this {fmt} log", path=path,
                            fix="pass the log of a run that logged at least one training step")
    steps = step_frame(rows)
    meta = {"format": fmt, "amp_dtype": amp_dtype, "world_size": 1, "params": [],
            "scaler": None if growth_interval is None else {"growth_interval": growth_interval}}
    return Run(path=path, source_format=fmt, meta=meta, metas={0: meta}, steps=steps.lazy(),
               layers=None, notes=[f"imported from a {fmt} log: no per-layer gradient norms, "
                                   "so stalled/vanishing/underflow checks cannot run", *notes])


def _first(d: dict[str, Any], keys) -> Any:
    for k in keys:
        if k in d and d[k] not in (None, ""):
            return d[k]
    return None


def _num(v) -> float | None:
    if v is None or v == "":
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _generic_rows(records: list[dict[str, Any]], path: Path, loss_keys=_LOSS_KEYS) -> pl.DataFrame:
    rows = []
    for r in records:
        step, loss = _num(r.get("step", r.get("global_step"))), _num(_first(r, loss_keys))
        if step is None or loss is None:
            continue  # validation/epoch rows carry no training loss
        gn = _num(_first(r, _GN_KEYS))
        if gn is None:
            gn = _num(next((v for k, v in r.items() if k.startswith("grad_") and "norm_total" in k), None))
        lr = _num(_first(r, _LR_KEYS))
        if lr is None:
            lr = _num(next((v for k, v in r.items() if k.startswith("lr-") and v not in (None, "")), None))
        skipped = r.get("skipped")
        rows.append({"step": int(step), "rank": int(_num(r.get("rank")) or 0), "loss": loss,
                     "scale": _num(_first(r, _SCALE_KEYS)), "grad_norm": gn, "lr": lr,
                     "skipped": None if skipped in (None, "") else str(skipped).lower() in ("1", "true", "1.0"),
                     "loss_dtype": r.get("loss_dtype") or None})
    if not rows:
        raise BadInputError(f"no rows with both 'step' and a loss column ({', '.join(_LOSS_KEYS[:4])}, ...)",
                            path=path, fix="log the training loss with its step, e.g. a 'step,loss' CSV")
    schema_ = {"step": pl.Int64, "rank": pl.Int32, "loss": pl.Float64, "scale": pl.Float64,
               "grad_norm": pl.Float64, "lr": pl.Float64, "skipped": pl.Boolean, "loss_dtype": pl.String}
    return pl.DataFrame(rows, schema=schema_)


def _import_hf(path: Path) -> Run:
    try:
        state = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInputError(f"not valid JSON ({e})", path=path, fix=_FIX) from e
    if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
        raise BadInputError("JSON without a 'log_history' list: not an HF trainer_state.json",
                            path=path, fix=_FIX)
    # only "loss": the end-of-training summary entry carries "train_loss" (a run average)
    rows = _generic_rows([e for e in state["log_history"] if isinstance(e, dict)], path, ("loss",))
    notes = []
    hidden = rows.filter(pl.col("loss").is_finite() & pl.col("grad_norm").is_not_null()
                         & ~pl.col("grad_norm").is_finite())
    if hidden.height:
        notes.append(f"HF logged a finite loss but a non-finite grad_norm at step {hidden['step'][0]}: "
                     "logging_nan_inf_filter (on by default) hides NaN losses; "
                     "set logging_nan_inf_filter=False to see them")
    return _run(path, "hf_trainer_state", rows, notes=notes)


def _import_csv(path: Path) -> Run:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or "step" not in reader.fieldnames:
            raise BadInputError(f"CSV without a 'step' column (columns: {reader.fieldnames})",
                                path=path, fix="add a 'step' column, or pass a Lightning CSVLogger metrics.csv")
        records = list(reader)
    fmt = "lightning_csv" if path.name == "metrics.csv" or "epoch" in (reader.fieldnames or []) else "csv"
    rows = _generic_rows(records, path)
    if fmt == "lightning_csv":  # Lightning logs _step and _epoch rows separately; keep one per step
        rows = rows.unique("step", keep="first")
    return _run(path, fmt, rows)


def _import_jsonl(path: Path) -> Run:
    records = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise BadInputError(f"line {i} is not JSON ({e.msg})", path=path,
                                fix="each line must be one JSON object with 'step' and 'loss'") from e
    return _run(path, "jsonl", _generic_rows([r for r in records if isinstance(r, dict)], path))


_DS_OVERFLOW = re.compile(r"OVERFLOW!\s+Rank\s+(\d+)\s+Skipping step\.\s+Attempted loss scale:\s*([\d.eE+-]+),"
                          r"\s*reducing to\s*([\d.eE+-]+)")
_DS_STEP = re.compile(r"\bstep=(\d+),\s*skipped=(\d+)")
_DS_LOSS = re.compile(r"\bsteps:\s*(\d+)\s+loss:\s*([-+\w.]+)")


def _import_deepspeed(path: Path, lines: list[str]) -> Run:
    """DeepSpeed counts skipped steps in global_steps, so an overflow line is one step."""
    step, scale, rows = 0, None, {}
    for line in lines:
        if m := _DS_OVERFLOW.search(line):
            if int(m[1]) != 0:
                continue  # rank 0 speaks for the data-parallel group: the scaler is synchronised
            step += 1
            rows[step] = {"step": step, "scale": float(m[2]), "skipped": True, "loss": None}
            scale = float(m[3])
        elif m := _DS_STEP.search(line):
            step = int(m[1])
        elif m := _DS_LOSS.search(line):
            step = int(m[1])
            r = rows.setdefault(step, {"step": step, "scale": scale, "skipped": False})
            r["loss"] = _num(m[2])  # float() reads "nan" and "inf" as DeepSpeed prints them
    if not rows:
        raise BadInputError("no DeepSpeed 'OVERFLOW!' or 'steps: N loss:' lines", path=path, fix=_FIX)
    df = pl.DataFrame(list(rows.values()), schema={"step": pl.Int64, "scale": pl.Float64,
                                                   "skipped": pl.Boolean, "loss": pl.Float64})
    return _run(path, "deepspeed_log", df.with_columns(rank=pl.lit(0)), amp_dtype="float16",
                growth_interval=1000,
                notes=["DeepSpeed log: only logged steps and overflow lines are known; "
                       "growth interval assumed to be loss_scale_window's default, 1000"])


_MEG = re.compile(r"iteration\s+(\d+)\s*/\s*\d+\s*\|(.*)")
_MEG_FIELD = re.compile(r"\s*([a-zA-Z][\w \-()/]*?)\s*:\s*([-+\w.]+)\s*")


def _import_megatron(path: Path, lines: list[str]) -> Run:
    rows, prev = [], 0
    for line in lines:
        m = _MEG.search(line)
        if not m:
            continue
        it = int(m[1])
        fields = {}
        for chunk in m[2].split("|"):
            if fm := _MEG_FIELD.fullmatch(chunk):
                fields[fm[1].strip().lower()] = fm[2]
        loss = next((_num(v) for k, v in fields.items() if k.endswith("loss") and "scale" not in k), None)
        nan_iters = int(_num(fields.get("number of nan iterations")) or 0)
        if nan_iters:
            loss = math.nan  # Megatron averages only finite losses; a nan count is a non-finite loss
        skipped = int(_num(fields.get("number of skipped iterations")) or 0)
        rows.append({"step": it, "loss": loss, "scale": _num(fields.get("loss scale")),
                     "grad_norm": _num(fields.get("grad norm")), "lr": _num(fields.get("learning rate")),
                     "skipped": skipped > 0, "n_iter": max(1, it - prev), "n_skipped": skipped})
        prev = it
    df = pl.DataFrame(rows, schema={"step": pl.Int64, "loss": pl.Float64, "scale": pl.Float64,
                                    "grad_norm": pl.Float64, "lr": pl.Float64, "skipped": pl.Boolean,
                                    "n_iter": pl.Int64, "n_skipped": pl.Int64})
    amp = "float16" if df["scale"].drop_nulls().len() else None
    return _run(path, "megatron_log", df.with_columns(rank=pl.lit(0)), amp_dtype=amp, growth_interval=1000,
                notes=["Megatron log: one row per log interval (losses are interval averages); "
                       "growth interval assumed to be --loss-scale-window's default, 1000"])


def _import_tensorboard(path: Path) -> Run:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as e:
        raise BadInputError("TensorBoard event files need the optional tensorboard package", path=path,
                            fix="pip install 'amp-autopsy[tensorboard]'") from e
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags().get("scalars", [])
    by_step: dict[int, dict[str, Any]] = {}
    for tag in tags:
        short = tag.split("/")[-1]
        for ev in acc.Scalars(tag):
            by_step.setdefault(ev.step, {"step": ev.step})[tag] = ev.value
            by_step[ev.step].setdefault(short, ev.value)
    return _run(path, "tensorboard", _generic_rows(list(by_step.values()), path))


def import_dir(path: Path, *, progress: bool = False) -> Run:
    """A directory without meta.json: an HF output dir, a Lightning log dir or TensorBoard events."""
    for name in ("trainer_state.json", "metrics.csv"):
        hits = sorted(path.rglob(name))
        if hits:
            progress_line(progress, f"importing {hits[-1]}")
            return import_file(hits[-1])
    if any(path.glob("**/events.out.tfevents*")):
        return _import_tensorboard(path)
    raise BadInputError(f"not a run directory: no {schema.META_FILE}", path=path, fix=_FIX)


def import_file(path: Path, *, progress: bool = False) -> Run:
    """Detect the tool that wrote `path` and map its rows onto the step columns."""
    progress_line(progress, f"importing {path}")
    suffix = path.suffix.lower()
    if path.name.startswith("events.out.tfevents"):
        return _import_tensorboard(path.parent)
    if suffix == ".json":
        return _import_hf(path)
    if suffix == ".csv":
        return _import_csv(path)
    if suffix in (".jsonl", ".ndjson"):
        return _import_jsonl(path)
    if suffix == ".parquet":
        raise BadInputError("a single Parquet part is not a run", path=path,
                            fix="pass the run directory (the one holding meta.json and trace/)")
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        raise BadInputError(f"cannot read ({e.strerror})", path=path, fix=_FIX) from e
    if any(_DS_OVERFLOW.search(x) or _DS_LOSS.search(x) for x in lines):
        return _import_deepspeed(path, lines)
    if any(_MEG.search(x) for x in lines):
        return _import_megatron(path, lines)
    raise BadInputError("unrecognised file: not a run directory, HF/Lightning/DeepSpeed/Megatron log, CSV or JSONL",
                        path=path, fix=_FIX)

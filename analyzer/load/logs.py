"""Map logs from other tools onto the recorder's step columns, so the same checks run on them.

Supported (detected by file name, then content):

- HF Trainer ``trainer_state.json``: ``log_history`` entries with ``loss``, ``grad_norm``,
  ``learning_rate``, ``step``; or the Trainer's ``output_dir``, whose newest ``trainer_state.json``
  (the highest ``global_step``, in ``checkpoint-N/`` or beside them) is read. A NaN/Inf
  ``grad_norm`` is a step with non-finite gradients. NB: HF's ``logging_nan_inf_filter`` (on by
  default) logs a NaN/Inf loss as the running mean (0.0 right after a log), so at a step whose
  ``grad_norm`` is NaN/Inf the logged loss is not trusted: it is read as unknown (null) and the
  row is marked ``loss_filtered``.
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

from ..errors import BadInputError
from ._limits import NumberTooLong, json_loads, safe_strings
from ._logcheck import LOG_PROBLEMS, Problems, count, number_cell, scale_value, short
from ._logcheck import to_float as _num
from .run import Run, progress_line, step_frame

__all__ = ["HF_TRAINER_STATE", "IMPORTED_LOGS", "LIGHTNING_METRICS", "LOG_PROBLEMS", "RUN_HINT", "TFEVENTS_PREFIX",
           "import_dir", "import_file"]

HF_TRAINER_STATE = "trainer_state.json"
LIGHTNING_METRICS = "metrics.csv"
IMPORTED_LOGS = (HF_TRAINER_STATE, LIGHTNING_METRICS)  # found by name in a directory, in this order
TFEVENTS_PREFIX = "events.out.tfevents"
# the fix of every "not a run" error, here and in run_dir
RUN_HINT = (f"pass a run directory written by the amp-autopsy Recorder, or a {HF_TRAINER_STATE}, "
            f"{LIGHTNING_METRICS}, DeepSpeed/Megatron log, CSV or JSONL file")
_LOSS_KEYS = ("loss", "train_loss_step", "train_loss", "train/loss", "loss_step", "training_loss", "lm_loss")
_SCALE_KEYS = ("scale", "loss_scale", "loss scale", "train/loss_scale", "grad_scale")
_GN_KEYS = ("grad_norm", "train/grad_norm", "grad_2.0_norm_total", "total_grad_norm", "gradient_norm")
_LR_KEYS = ("lr", "learning_rate", "train/learning_rate")
_I64 = 2**63
_MAX_LINE = 16 << 20  # a log line longer than 16 MiB is not a log line


def _run(path: Path, fmt: str, rows: pl.DataFrame, *, amp_dtype=None, growth_interval=None,
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


def _read_json(path: Path) -> Any:
    try:
        return safe_strings(json_loads(path.read_bytes().decode("utf-8")))
    except NumberTooLong as e:
        raise BadInputError(str(e), path=path, fix=RUN_HINT) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInputError(f"not valid JSON ({e})"[:300], path=path, fix=RUN_HINT) from e
    except RecursionError as e:
        raise BadInputError("JSON nested too deeply to read", path=path, fix=RUN_HINT) from e


def _lines(path: Path, *, errors: str = "strict"):
    """(number, text) per line, refusing a line over ``_MAX_LINE`` bytes instead of reading it all."""
    with path.open("rb") as f:
        for i, raw in enumerate(iter(lambda: f.readline(_MAX_LINE + 1), b""), 1):
            if len(raw) > _MAX_LINE and not raw.endswith(b"\n"):
                raise BadInputError(f"line {i} is longer than {_MAX_LINE >> 20} MiB: not a log", path=path,
                                    fix=RUN_HINT)
            try:
                yield i, raw.decode("utf-8", errors=errors).rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise BadInputError(f"line {i} is not UTF-8 text ({e.reason})", path=path, fix=RUN_HINT) from e


def _whole(v, path: Path, what: str, lo: int, hi: int) -> int:
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


def _generic_rows(records: list[tuple[str, dict[str, Any]]], path: Path, bad: Problems,
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
        step = _whole(raw_step, path, "step", -_I64, _I64)
        rank = 0 if _num(r.get("rank")) is None else _whole(r.get("rank"), path, "rank", 0, 2**31)
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


def _import_hf(path: Path) -> Run:
    state = _read_json(path)
    if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
        raise BadInputError("JSON without a 'log_history' list: not an HF trainer_state.json",
                            path=path, fix=RUN_HINT)
    # only "loss": the end-of-training summary entry carries "train_loss" (a run average)
    bad = Problems()
    rows = _generic_rows([(f"log_history[{i}]", e) for i, e in enumerate(state["log_history"]) if isinstance(e, dict)],
                         path, bad, ("loss",))
    notes = []
    gn = pl.col("grad_norm")
    hidden = pl.col("loss").is_finite() & gn.is_not_null() & ~gn.is_finite()
    first = rows.filter(hidden)
    if first.height:
        notes.append(f"HF logged a finite loss but a non-finite grad_norm at {first.height} step(s), first at "
                     f"step {first['step'][0]}: logging_nan_inf_filter (on by default) logs a NaN/Inf loss as the "
                     "running mean, so those losses are read as unknown; set logging_nan_inf_filter=False to "
                     "log the real ones")
    rows = rows.with_columns(loss_filtered=hidden, loss=pl.when(hidden).then(None).otherwise(pl.col("loss")))
    return _run(path, "hf_trainer_state", rows, notes=notes, bad=bad)


def _import_csv(path: Path) -> Run:
    bad = Problems()
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames or "step" not in reader.fieldnames:
                cols = str(reader.fieldnames)[:200]
                raise BadInputError(f"CSV without a 'step' column (columns: {cols})", path=path,
                                    fix="add a 'step' column, or pass a Lightning CSVLogger metrics.csv")
            header = list(reader.fieldnames)
            for name in sorted({c for c in header if header.count(c) > 1}):
                bad.add("header", f"column {short(name)} appears {header.count(name)} times (the last one is read)")
            records, shape = [], {}
            for r in reader:
                where = f"line {reader.line_num}"
                n = len(header) - sum(v is None for v in r.values()) + len(r.get(None) or ())
                if n != len(header):  # DictReader files extra fields under None and fills missing ones with None
                    shape[where] = f"{n} field(s), the header has {len(header)}"
                records.append((where, r))
    except UnicodeDecodeError as e:
        raise BadInputError(f"not UTF-8 text ({e.reason} at byte {e.start})", path=path, fix=RUN_HINT) from e
    except csv.Error as e:
        raise BadInputError(f"malformed CSV ({e})"[:300], path=path, fix=RUN_HINT) from e
    fmt = "lightning_csv" if path.name == LIGHTNING_METRICS or "epoch" in header else "csv"
    rows = _generic_rows(records, path, bad, shape=shape)
    if fmt == "lightning_csv":  # Lightning logs _step and _epoch rows separately; keep one per step
        rows = rows.unique("step", keep="first")
    return _run(path, fmt, rows, bad=bad)


def _import_jsonl(path: Path) -> Run:
    records, bad = [], Problems()
    for i, line in _lines(path):
        if not line.strip():
            continue
        try:
            records.append((f"line {i}", safe_strings(json_loads(line))))
        except NumberTooLong as e:
            raise BadInputError(f"line {i} {e}", path=path, fix="each line must be one JSON object with 'step' and "
                                "'loss'") from e
        except (json.JSONDecodeError, RecursionError) as e:
            msg = getattr(e, "msg", "nested too deeply")
            raise BadInputError(f"line {i} is not JSON ({msg})", path=path,
                                fix="each line must be one JSON object with 'step' and 'loss'") from e
    rows = _generic_rows([(w, r) for w, r in records if isinstance(r, dict)], path, bad)
    return _run(path, "jsonl", rows, bad=bad)


# the scales as any token up to the comma, so that an unreadable one is named, not the line skipped
_DS_OVERFLOW = re.compile(r"OVERFLOW!\s+Rank\s+(\d+)\s+Skipping step\.\s+Attempted loss scale:\s*([^,\s]*)\s*,"
                          r"\s*reducing to\s*([^\s,]*)")
_DS_STEP = re.compile(r"\bstep=(\d+),\s*skipped=(\d+)")
_DS_LOSS = re.compile(r"\bsteps:\s*(\d+)\s+loss:\s*([-+\w.]+)")


def _import_deepspeed(path: Path, lines: list[str]) -> Run:
    """DeepSpeed counts skipped steps in global_steps, so an overflow line is one step."""
    step, scale, rows, bad = 0, None, {}, Problems()
    for i, line in enumerate(lines, 1):
        if m := _DS_OVERFLOW.search(line):
            if _whole(m[1], path, "rank", 0, 2**31) != 0:
                continue  # rank 0 speaks for the data-parallel group: the scaler is synchronised
            step += 1
            rows[step] = {"step": step, "scale": scale_value(m[2], f"line {i}", "attempted loss scale", bad), "skipped": True, "loss": None}
            scale = scale_value(m[3], f"line {i}", "reduced loss scale", bad)
        elif m := _DS_STEP.search(line):
            step = _whole(m[1], path, "step", 0, _I64 >> 1)
        elif m := _DS_LOSS.search(line):
            step = _whole(m[1], path, "step", 0, _I64 >> 1)
            r = rows.setdefault(step, {"step": step, "scale": scale, "skipped": False})
            # float() reads "nan" and "inf" as DeepSpeed prints them
            r["loss"] = number_cell(m[2], f"line {i}", "loss", bad)
    if not rows:
        raise BadInputError("no DeepSpeed 'OVERFLOW!' or 'steps: N loss:' lines", path=path, fix=RUN_HINT)
    df = pl.DataFrame(list(rows.values()), schema={"step": pl.Int64, "scale": pl.Float64,
                                                   "skipped": pl.Boolean, "loss": pl.Float64})
    return _run(path, "deepspeed_log", df.with_columns(rank=pl.lit(0)), amp_dtype="float16",
                growth_interval=1000, bad=bad,
                notes=["DeepSpeed log: only logged steps and overflow lines are known; "
                       "growth interval assumed to be loss_scale_window's default, 1000"])


# the iteration as any token, so that "nan" or "1e999" is refused rather than the line skipped
_MEG = re.compile(r"iteration\s+([-+]?[\w.]+)\s*/\s*[-+]?[\w.]+\s*\|(.*)")
_MEG_FIELD = re.compile(r"\s*([a-zA-Z][\w \-()/]*?)\s*:\s*([-+\w.]+)\s*")
_MEG_NUMBERS = ("loss scale", "grad norm", "learning rate")


def _import_megatron(path: Path, lines: list[str]) -> Run:
    rows, prev, bad = [], 0, Problems()
    for i, line in enumerate(lines, 1):
        m = _MEG.search(line)
        if not m:
            continue
        it, where = _whole(m[1], path, f"line {i}: iteration", 0, _I64), f"line {i}"
        fields = {}
        for chunk in m[2].split("|"):
            if fm := _MEG_FIELD.fullmatch(chunk):
                fields[fm[1].strip().lower()] = fm[2]
        n_iter = max(1, it - prev)
        loss = next((number_cell(v, where, k, bad) for k, v in fields.items() if k.endswith("loss") and "scale" not in k),
                    None)
        nums = {k: number_cell(fields.get(k), where, k, bad) for k in _MEG_NUMBERS}
        if nums["loss scale"] is not None:
            nums["loss scale"] = scale_value(fields["loss scale"], where, "loss scale", bad)
        if count(fields.get("number of nan iterations"), n_iter, where, "number of nan iterations", bad):
            loss = math.nan  # Megatron averages only finite losses; a nan count is a non-finite loss
        skipped = count(fields.get("number of skipped iterations"), n_iter, where, "number of skipped iterations", bad)
        rows.append({"step": it, "loss": loss, "scale": nums["loss scale"], "grad_norm": nums["grad norm"],
                     "lr": nums["learning rate"], "skipped": skipped > 0, "n_iter": n_iter, "n_skipped": skipped})
        prev = it
    df = pl.DataFrame(rows, schema={"step": pl.Int64, "loss": pl.Float64, "scale": pl.Float64,
                                    "grad_norm": pl.Float64, "lr": pl.Float64, "skipped": pl.Boolean,
                                    "n_iter": pl.Int64, "n_skipped": pl.Int64})
    amp = "float16" if df["scale"].drop_nulls().len() else None
    return _run(path, "megatron_log", df.with_columns(rank=pl.lit(0)), amp_dtype=amp, growth_interval=1000, bad=bad,
                notes=["Megatron log: one row per log interval (losses are interval averages); "
                       "growth interval assumed to be --loss-scale-window's default, 1000"])


def _import_tensorboard(path: Path) -> Run:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as e:
        raise BadInputError("TensorBoard event files need the optional tensorboard package", path=path,
                            fix="pip install 'amp-autopsy[tensorboard]'") from e
    try:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        tags = acc.Tags().get("scalars", [])
    except Exception as e:  # noqa: BLE001 - tensorboard's reader raises many types on damaged events
        raise BadInputError(f"unreadable TensorBoard events ({type(e).__name__}: {str(e)[:160]})",
                            path=path, fix=RUN_HINT) from e
    by_step: dict[int, dict[str, Any]] = {}
    for tag in tags:
        short = tag.split("/")[-1]
        for ev in acc.Scalars(tag):
            by_step.setdefault(ev.step, {"step": ev.step})[tag] = ev.value
            by_step[ev.step].setdefault(short, ev.value)
    bad = Problems()
    rows = _generic_rows([(f"step {s}", r) for s, r in by_step.items()], path, bad)
    return _run(path, "tensorboard", rows, bad=bad)


_MAX_STATES = 10_000  # trainer_state.json files weighed to find the newest; past that, by mtime only


def _global_step(path: Path) -> int:
    """A trainer_state.json's global_step (-1 when unreadable or absent), read to rank candidates."""
    try:
        if path.stat().st_size > _MAX_LINE:
            return -1
        v = json.loads(path.read_bytes()).get("global_step")
    except (OSError, ValueError, AttributeError, RecursionError):
        return -1
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _I64 else -1


def _newest(hits: list[Path], by_step: bool) -> Path:
    """The newest file: the highest global_step (HF), then the latest mtime; never name order
    (checkpoint-10 sorts before checkpoint-9, version_10 before version_9)."""
    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return -1.0
    if by_step and len(hits) <= _MAX_STATES:
        return max(hits, key=lambda p: (_global_step(p), mtime(p), str(p)))
    return max(hits, key=lambda p: (mtime(p), str(p)))


def import_dir(path: Path, *, progress: bool = False) -> Run:
    """A directory without meta.json: an HF output dir, a Lightning log dir or TensorBoard events."""
    for name in IMPORTED_LOGS:
        hits = sorted(path.rglob(name))
        if hits:
            newest = _newest(hits, by_step=name == HF_TRAINER_STATE)
            progress_line(progress, f"importing {newest}")
            return import_file(newest)
    if any(path.glob(f"**/{TFEVENTS_PREFIX}*")):
        return _import_tensorboard(path)
    if (path / "training_args.bin").exists() or any(path.glob("checkpoint-*")):
        raise BadInputError("an HF Trainer output directory without a trainer_state.json", path=path,
                            fix="HF writes trainer_state.json into each checkpoint-N/ (save_strategy='steps') and "
                                "with trainer.save_state(); or record the run with the amp-autopsy callback")
    raise BadInputError(f"not a run directory: no {schema.META_FILE}", path=path, fix=RUN_HINT)


def import_file(path: Path, *, progress: bool = False) -> Run:
    """Detect the tool that wrote `path` and map its rows onto the step columns."""
    progress_line(progress, f"importing {path}")
    suffix = path.suffix.lower()
    if path.name.startswith(TFEVENTS_PREFIX):
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
        lines = [line for _, line in _lines(path, errors="replace")]
    except OSError as e:
        raise BadInputError(f"cannot read ({e.strerror})", path=path, fix=RUN_HINT) from e
    if any(_DS_OVERFLOW.search(x) or _DS_LOSS.search(x) for x in lines):
        return _import_deepspeed(path, lines)
    if any(_MEG.search(x) for x in lines):
        return _import_megatron(path, lines)
    raise BadInputError("unrecognised file: not a run directory, HF/Lightning/DeepSpeed/Megatron log, CSV or JSONL",
                        path=path, fix=RUN_HINT)

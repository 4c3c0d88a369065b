"""Read a run lazily: a recorder run directory (all ranks, all parts), with version checks.

``load_run(path)`` returns a ``Run`` whose ``steps``, ``layers`` and ``fp8`` are polars LazyFrames over
the Parquet parts (``recorders.schema`` columns, cast to the schema's dtypes): nothing is read
but the parts' footers until a query is collected. A data page that does not decode is found by
the first query that reads it; ``Run.diagnose`` then names the part. Logs from other tools (HF Trainer,
Lightning, DeepSpeed, Megatron, CSV, JSONL, TensorBoard) are mapped onto the same step
columns by ``analyzer.load.logs`` (one module per tool); they have no per-layer table.

Every problem becomes a one-line ``BadInputError`` / ``VersionError`` naming the file and the
fix. A run whose process was killed is read up to its last complete part; ``Run.notes`` says so.
Nothing here writes to the run directory.

Example:
    >>> run = load_run("runs/gpt-fp16")                      # doctest: +SKIP
    >>> run.steps.select(pl.len()).collect().item()          # doctest: +SKIP
    1200
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import polars as pl

from recorders import schema

from ..errors import BadInputError, VersionError
from ._limits import NumberTooLong, json_loads, safe_strings
from ._tracecheck import (READ_ERRORS, check_part_ranks, check_part_types, check_parts_decode, quiet_native_stderr,
                          validate_meta)
from .logs import RUN_HINT, import_dir, import_file
from .run import Run, SnapshotInfo, progress_line
from .shards import shard_table
from .compiled import clean_name
from .versions import check_format_version
from .which import torch_file_given_to_report

__all__ = ["load_run", "read_meta", "snapshot_info"]

_PART_RE = schema.PART_RE
_COLUMNS = {"steps": schema.STEP_COLUMNS, "layers": schema.LAYER_COLUMNS, "fp8": schema.FP8_COLUMNS}
_SNAP_RE = schema.SNAPSHOT_RE


def read_meta(path: Path, like: _Known | None = None) -> dict[str, Any]:
    """Read and version-check one meta.json; raise a one-line error naming the file.

    `like`: a meta.json of the same run, already read (``_Known``). Ranks' meta files repeat most
    of it (the parameters, the optimizer, the scaler): a value whose ``repr`` is one of its values'
    is that value, checked already, and is taken from it instead of checked again. The others are
    checked here. NB: ``repr`` tells ``1``, ``1.0`` and ``True`` apart, where ``==`` does not.
    """
    try:
        meta = json_loads(path.read_text())
    except NumberTooLong as e:
        raise BadInputError(f"meta.json {e}", path=path,
                            fix="the run's meta.json is damaged; restore it from the training host") from e
    except FileNotFoundError:
        raise BadInputError("no such file", path=path, fix=RUN_HINT) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInputError(f"not valid JSON ({e})", path=path,
                            fix="the run's meta.json is damaged; restore it from the training host") from e
    except RecursionError as e:
        raise BadInputError("JSON nested too deeply to read", path=path,
                            fix="the run's meta.json is damaged; restore it from the training host") from e
    if not isinstance(meta, dict) or meta.get("format") != schema.META_FORMAT:
        raise BadInputError(f"not an amp-autopsy meta file (no 'format': '{schema.META_FORMAT}')",
                            path=path, fix=RUN_HINT)
    check_format_version(meta, path=path, what="run")
    known = like.values(meta) if like is not None else {}
    rest = {k: v for k, v in meta.items() if k not in known}
    validate_meta(rest, path)  # ranks, shapes, numels: integers in range, bounded nesting
    safe_strings(rest)  # a lone surrogate in a name would crash the checks that format it
    return {k: known[k] if k in known else rest[k] for k in meta}


class _Known:
    """A meta.json already read and checked, by the ``repr`` of each of its values (``read_meta``)."""

    def __init__(self, meta: dict[str, Any]):
        self.meta = meta
        self.reprs = {k: _repr(v) for k, v in meta.items()}

    def values(self, meta: dict[str, Any]) -> dict[str, Any]:
        """{key: the checked value} for each value of `meta` that is the same as this one's."""
        return {k: self.meta[k] for k, v in meta.items()
                if k in self.reprs and self.reprs[k] is not None and _repr(v) == self.reprs[k]}


def _repr(v: Any) -> str | None:
    try:
        return repr(v)
    except RecursionError:  # nested deeper than repr goes: checked (and refused) on its own
        return None


def _param_names(meta: dict[str, Any]) -> tuple[list[str], list[int | None]]:
    """meta["params"] as names and numels; entries may be names or dicts with name/shape/numel."""
    names, numels = [], []
    for i, p in enumerate(meta.get("params") or []):
        if isinstance(p, str):
            names.append(clean_name(p))
            numels.append(None)
            continue
        if isinstance(p, (list, tuple)) and p and isinstance(p[0], str):  # [name, shape]
            p = {"name": p[0], "shape": p[1] if len(p) > 1 else None}
        if not isinstance(p, dict):
            names.append(f"param{i}")
            numels.append(None)
            continue
        names.append(clean_name(str(p.get("name", f"param{i}"))))  # runs older than version 5: no _orig_mod.
        numel = p.get("numel")
        if numel is None and isinstance(p.get("shape"), (list, tuple)):
            numel = 1
            for d in p["shape"]:
                numel *= int(d)
        numels.append(None if numel is None else int(numel))
    return names, numels


def _check_part(path: Path, kind: str) -> frozenset[str]:
    """Read only the footer: a truncated, foreign or newer part fails here, naming the file.

    Returns the part's column names. Columns added after version 1 (``schema.COLUMNS_ADDED``) may
    be missing: parts of older runs lack them, and readers give null.
    """
    expected = _COLUMNS[kind]
    if path.stat().st_size == 0:
        raise BadInputError("empty Parquet part (0 bytes)", path=path,
                            fix="move the damaged part out of trace/ to analyse the rest of the run")
    try:
        # NB: scan with glob=False reads only the footer, and a '[' in the path is no pattern
        with quiet_native_stderr():  # a panic's backtrace must not precede the Error: line
            cols = pl.scan_parquet(path, glob=False).collect_schema()
    except READ_ERRORS as e:  # polars raises several types (panics are BaseException) for a damaged footer
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise BadInputError(f"truncated or corrupt Parquet part ({first[:120]})", path=path,
                            fix="move the damaged part out of trace/ to analyse the rest of the run") from e
    check_part_types(path, cols, expected)
    if path.stat().st_size <= _SMALL_PART and _rows(path) == 0:
        raise BadInputError(f"{kind} part holds no rows: the Recorder never writes an empty part, so the steps it "
                            "held are gone", path=path, fix="move the damaged part out of trace/ to analyse the rest "
                            "of the run, or restore it from the training host")
    missing = [c for c in expected if c not in cols and c not in schema.COLUMNS_ADDED]
    unknown = [c for c in cols if c not in expected]
    if missing and len(missing) >= len(expected) // 2:
        raise BadInputError(f"foreign Parquet part: none of the {kind} trace columns {sorted(missing)[:4]}...",
                            path=path, fix="trace/ must hold only parts written by the Recorder; move this file out")
    if missing:
        raise BadInputError(f"Parquet part lacks {kind} columns {missing}", path=path,
                            fix="trace/ must hold only parts written by the Recorder; move this file out")
    if unknown:
        raise VersionError(
            f"Parquet part has columns unknown to format version {schema.FORMAT_VERSION}: {unknown}",
            path=path, fix="it was written by a newer amp-autopsy: pip install -U amp-autopsy")
    return frozenset(cols)


_SMALL_PART = 16 << 10  # parts this small may hold no rows: their row count is read (0.5 ms each; larger ones are not)


def _rows(path: Path) -> int:
    """A part's row count, from its footer."""
    try:
        with quiet_native_stderr():
            return int(pl.scan_parquet(path, glob=False).select(pl.len()).collect().item())
    except READ_ERRORS:  # a footer that gave its schema but not its count: the first query names the part
        return -1


def _scan(files: list[Path], columns: dict[str, pl.DataType],
          present: dict[Path, frozenset[str]] | None = None) -> pl.LazyFrame:
    """One lazy frame over `files` with exactly `columns`; a column a part lacks (`present`) is null."""
    groups: dict[tuple[str, ...], list[Path]] = {}
    for f in files:
        have = tuple(c for c in columns if present is None or c in present.get(f, columns))
        groups.setdefault(have, []).append(f)
    frames = [pl.scan_parquet([str(f) for f in fs], glob=False).select(
        [pl.col(c).cast(t) if c in have else pl.lit(None, dtype=t).alias(c) for c, t in columns.items()])
        for have, fs in groups.items()]
    return frames[0] if len(frames) == 1 else pl.concat(frames, how="vertical")


def _listing(directory: Path) -> list[str]:
    """Names in `directory`, sorted ([] if it is absent): listed, never globbed, so any path is safe."""
    try:
        with os.scandir(directory) as entries:
            return sorted(e.name for e in entries)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _read_metas(path: Path, first: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
    """{(rank, writer): meta} from every meta file in the run directory; `first`: its meta.json, read."""
    metas, like = {}, _Known(first)
    for name in _listing(path):
        m = schema.META_RE.match(name)
        if m:
            meta = first if name == schema.META_FILE else read_meta(path / name, like)  # (read once)
            rank = 0 if m[1] is None else int(m[1])
            recorded = meta.get("rank", rank)
            if recorded != rank:  # validated an int: a meta file copied or renamed from another rank
                raise BadInputError(f"records rank {recorded}, but its name is rank {rank}'s", path=path / name,
                                    fix=f"rank {recorded}'s meta file is named {schema.meta_name(recorded)}: "
                                        "restore the run's files under their own names")
            metas[(rank, int(m[2] or 0))] = meta
    return metas


def _stream_ranks(keys) -> dict[tuple[int, int], int]:
    """Frame rank of each (rank, writer): writer 0 keeps its rank; extra writers get unused numbers."""
    real = {r for r, _ in keys}
    nxt = max(real, default=-1) + 1
    out = {}
    for r, w in sorted(keys):
        if w == 0:
            out[(r, w)] = r
        else:
            out[(r, w)] = nxt
            nxt += 1
    return out


def _writer_notes(metas, shown: dict[tuple[int, int], int]) -> list[str]:
    """'2 processes wrote rank 0: pid A on host X, pid B on host Y (...)' per shared rank."""
    notes = []
    for rank in sorted({r for r, w in shown if w}):
        keys = sorted(k for k in shown if k[0] == rank)
        who = ", ".join(f"pid {metas.get(k, {}).get('pid')} on host {metas.get(k, {}).get('host')}"
                        for k in keys)
        extra = "; ".join(f"writer {w}'s steps are rank {shown[(r, w)]} here" for r, w in keys if w)
        notes.append(f"{len(keys)} processes wrote rank {rank}: {who} (analysed separately, never mixed: "
                     f"{extra}; launch with torch.distributed initialised so each process has its own rank)")
    return notes


def _load_run_dir(path: Path, progress: bool) -> Run:
    meta = read_meta(path / schema.META_FILE)
    by_writer = _read_metas(path, meta)

    trace = path / schema.TRACE_DIR
    # parts[kind][(rank, writer)] = [(index, file)]
    parts: dict[str, dict[tuple[int, int], list[tuple[int, Path]]]] = {k: {} for k in schema.PART_KINDS}
    temps = []
    for name in _listing(trace):
        if name.startswith("."):
            temps.append(name)  # an unfinished atomic write: the writer died mid-part
            continue
        m = _PART_RE.match(name)
        if m:
            parts[m[1]].setdefault((int(m[2]), int(m[3] or 0)), []).append((int(m[4]), trace / name))
    streams = set(parts["steps"]) | set(parts["layers"]) | set(by_writer)
    shown = _stream_ranks(streams)
    step_files = [f for k in sorted(parts["steps"]) for _, f in sorted(parts["steps"][k])]
    layer_files = [f for k in sorted(parts["layers"]) for _, f in sorted(parts["layers"][k])]
    fp8_files = [f for k in sorted(parts["fp8"]) for _, f in sorted(parts["fp8"][k])]  # since version 8
    begun = meta.get("steps_begun")
    if not step_files and isinstance(begun, int) and not isinstance(begun, bool) and begun > 0:
        raise BadInputError(
            f"empty trace: begin_step ran {begun} time(s) but end_step never recorded a step", path=path,
            fix="call rec.end_step(loss) with the unscaled loss after backward, before optimizer.step(), on every step")
    if not step_files:
        raise BadInputError(
            f"empty trace: no {schema.TRACE_DIR}/{schema.STEPS_GLOB} parts",
            path=path, fix="the run recorded no steps or was killed before its first flush; "
            "record longer or lower flush_every")
    total = sum(f.stat().st_size for f in step_files + layer_files)
    progress_line(progress, f"checking {len(step_files) + len(layer_files)} trace parts "
                        f"({total / 2**20:.1f} MiB) in {trace}")
    present = {f: _check_part(f, "steps") for f in step_files}  # each part's columns (older parts lack some)
    present.update({f: _check_part(f, "layers") for f in layer_files})
    present.update({f: _check_part(f, "fp8") for f in fp8_files})
    check_part_ranks(parts["steps"], present)  # rows of another rank under this rank's name would mix two streams

    def diagnose() -> None:
        """Decode every part (only after a query failed): a corrupt page or a null key is named."""
        check_parts_decode(step_files, schema.STEP_COLUMNS, present)
        check_parts_decode(layer_files, schema.LAYER_COLUMNS, present)
        check_parts_decode(fp8_files, schema.FP8_COLUMNS, present)

    metas = {int(meta.get("rank", 0) or 0): meta}
    for (r, w), m in by_writer.items():
        metas[shown[(r, w)]] = m
    notes, partial = _writer_notes(by_writer, shown), False
    if temps:
        partial = True
        notes.append(f"partial run: {len(temps)} unfinished temporary file(s) in {trace} "
                     "(the process was probably killed while writing); analysed the complete parts only")
    for key in sorted(by_writer):
        if key not in parts["steps"]:
            partial = True
            notes.append(f"rank {shown[key]} has a meta file but no trace parts (it died before its first flush)")
    params, numels = _param_names(meta)
    layers = None
    steps_lf = _scan_streams(parts["steps"], shown, schema.STEP_COLUMNS, present)
    if layer_files:
        layers = _scan_streams(parts["layers"], shown, schema.LAYER_COLUMNS, present)
        for key, sp in parts["steps"].items():
            lp = parts["layers"].get(key, [])
            if lp and max(i for i, _ in lp) < max(i for i, _ in sp):
                partial = True
                notes.append(f"partial run: rank {shown[key]}'s last steps part has no layers part "
                             "(killed between the two writes); per-layer checks end earlier")

    fp8 = _fp8_uses(_scan_streams(parts["fp8"], shown, schema.FP8_COLUMNS, present)) if fp8_files else None

    sdir = path / schema.SNAPSHOT_DIR
    snapshots = [sdir / n for n in _listing(sdir) if not n.startswith(".") and _SNAP_RE.match(n)]
    writers = {shown[k]: k for k in shown if k[1]}
    shards = shard_table(metas, meta, path)  # FSDP2: the layer rows are shards, merged by the report
    if shards is not None:
        notes.append(f"sharded (FSDP2) run: per-parameter statistics merge the shards of "
                     f"{meta.get('world_size')} ranks into whole parameters (steps some rank did not record "
                     "are left out of them)")
    return Run(path=path, source_format="amp-autopsy", meta=meta, metas=metas, steps=steps_lf,
               layers=layers, params=params, numels=numels, snapshots=snapshots, notes=notes,
               partial=partial, writers=writers, shards=shards, diagnose=diagnose, fp8=fp8)


def _scan_streams(parts: dict[tuple[int, int], list[tuple[int, Path]]], shown: dict[tuple[int, int], int],
                  columns: dict[str, pl.DataType], present: dict[Path, frozenset[str]] | None = None) -> pl.LazyFrame:
    """One scan over every writer-0 part; one per extra writer, its rows relabelled to its own rank."""
    first = [f for k in sorted(parts) if k[1] == 0 for _, f in sorted(parts[k])]
    frames = [_scan(first, columns, present)] if first else []
    for key in sorted(k for k in parts if k[1]):
        frames.append(_scan([f for _, f in sorted(parts[key])], columns, present)
                      .with_columns(rank=pl.lit(shown[key], dtype=columns["rank"])))
    return frames[0] if len(frames) == 1 else pl.concat(frames, how="vertical")


def _fp8_uses(lf: pl.LazyFrame) -> pl.LazyFrame:
    """The fp8 rows with every ``use`` named: a part of format 8 has none and measured each role's first use."""
    first = pl.col("role").replace_strict(schema.FP8_FIRST_USE, default=None, return_dtype=pl.String)
    return lf.with_columns(use=pl.coalesce(pl.col("use"), first))


def snapshot_info(path: Path) -> SnapshotInfo:
    """step, rank, reason and writer (0: the rank's first process) parsed from a snapshot's file name."""
    m = _SNAP_RE.match(path.name)
    if not m:
        return SnapshotInfo(str(path))
    return SnapshotInfo(str(path), step=int(m[1]), rank=int(m[2]), reason=m[4], writer=int(m[3] or 0))


def load_run(path: str | Path, *, progress: bool = False) -> Run:
    """Open a run directory or a foreign log for reading. Raises BadInputError / VersionError."""
    p = Path(path)
    if not p.exists():
        raise BadInputError("no such file or directory", path=p, fix=RUN_HINT)
    if p.is_file() and p.name == schema.META_FILE:
        p = p.parent
    if p.is_dir():
        if (p / schema.META_FILE).exists():
            return _load_run_dir(p, progress)
        return import_dir(p, progress=progress)
    wrong = torch_file_given_to_report(p)  # a snapshot or a checkpoint: name replay / inspect
    if wrong is not None:
        raise wrong
    return import_file(p, progress=progress)

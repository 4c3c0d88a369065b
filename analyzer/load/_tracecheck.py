"""Validate a run directory's meta.json values and Parquet parts before any check reads them.

``run_dir.load_run`` calls these so that the checks can trust what they get:

- meta.json: ranks, world sizes, parameter names, shapes and numels are integers in range (a
  hostile ``"rank": 1e400`` or ``"shape": [true, -1]`` is one error naming the file, not a
  ``ValueError`` deep in a check), and nesting is bounded;
- Parquet parts: every column has the schema's type (a ``step`` column of strings would pass the
  name check and fail at the first query), checked on the footer at load; and, once a query over
  the trace has failed, every part is decoded (``check_parts_decode``, one streaming pass) so that
  a part whose footer is fine but whose data pages are corrupt is named.

Nothing here imports torch: ``analyzer report`` stays light.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import polars as pl

from recorders import schema

from ._limits import check_nesting
from .compiled import read_compile
from ..errors import BadInputError

__all__ = ["validate_meta", "check_part_types", "check_parts_decode", "check_part_ranks", "READ_ERRORS",
           "quiet_native_stderr"]

_META_FIX = "the run's meta.json is damaged; restore it from the training host or re-record the run"
_PART_FIX = "move the damaged part out of trace/ to analyse the rest of the run"
_I64 = 2**63


def _whole(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi


def _bad_meta(path, detail: str) -> BadInputError:
    return BadInputError(f"meta.json {detail}"[:300], path=path, fix=_META_FIX)


def _validate_param(p: Any, i: int, path) -> None:
    if isinstance(p, str):
        return
    if isinstance(p, (list, tuple)):
        if not p or not isinstance(p[0], str):
            raise _bad_meta(path, f"params[{i}] should start with the parameter's name")
        p = {"name": p[0], "shape": p[1] if len(p) > 1 else None}
    if not isinstance(p, dict):
        raise _bad_meta(path, f"params[{i}] is a {type(p).__name__}, not a name or a dict")
    name = p.get("name")
    if name is not None and not isinstance(name, str):
        raise _bad_meta(path, f"params[{i}] name is a {type(name).__name__}, not a string")
    shape = p.get("shape")
    if shape is not None:
        if not isinstance(shape, (list, tuple)) or len(shape) > 64 or not all(_whole(d, 0, _I64) for d in shape):
            raise _bad_meta(path, f"params[{i}] shape {shape!r} is not a list of non-negative integers")
        numel = 1
        for d in shape:
            numel *= d
        if numel >= _I64:
            raise _bad_meta(path, f"params[{i}] shape {shape!r} has more than 2**63 elements")
    numel = p.get("numel")
    if numel is not None and not _whole(numel, 0, _I64):
        raise _bad_meta(path, f"params[{i}] numel {numel!r} is not a non-negative integer")


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _validate_optimizer(opt: Any, path) -> None:
    """meta["optimizer"] (version 3): None, or {"class": str, "param_groups": [{hyperparameter: JSON
    scalar or list of scalars, "params": [layer index or None]}]}, as the recorder writes it."""
    if opt is None:
        return
    if not isinstance(opt, dict) or not isinstance(opt.get("class"), str) \
            or not isinstance(opt.get("param_groups"), list):
        raise _bad_meta(path, "optimizer should be null or {'class': str, 'param_groups': [...]}")
    for i, group in enumerate(opt["param_groups"]):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list) \
                or not all(j is None or _whole(j, 0, 2**31) for j in group["params"]):
            raise _bad_meta(path, f"optimizer param_groups[{i}] should hold 'params': a list of layer indices")
        for key, v in group.items():
            if key != "params" and not (_scalar(v) or (isinstance(v, list) and all(_scalar(x) for x in v))):
                raise _bad_meta(path, f"optimizer param_groups[{i}] {key!r} is not a number, string or list of them")


def validate_meta(meta: dict[str, Any], path: str | os.PathLike) -> None:
    """Check the meta.json values the analyzer uses; raise one BadInputError naming the file."""
    check_nesting(meta, path=path, what="meta.json")
    rank = meta.get("rank")
    if rank is not None and not _whole(rank, 0, 2**31):
        raise _bad_meta(path, f"rank {rank!r} is not an integer in [0, 2**31)")
    ws = meta.get("world_size")
    if ws is not None and not _whole(ws, 1, 2**31):
        raise _bad_meta(path, f"world_size {ws!r} is not an integer in [1, 2**31)")
    for key in ("amp_dtype", "host", "device_type", "torch_version"):
        v = meta.get(key)
        if v is not None and not isinstance(v, str):
            raise _bad_meta(path, f"{key} is a {type(v).__name__}, not a string")
    scaler = meta.get("scaler")
    if scaler is not None and not isinstance(scaler, dict):
        raise _bad_meta(path, f"scaler is a {type(scaler).__name__}, not a dict")
    _validate_optimizer(meta.get("optimizer"), path)
    numbering = meta.get("step_numbering")  # since version 4
    if numbering is not None and numbering not in schema.STEP_NUMBERINGS:
        raise _bad_meta(path, f"step_numbering {str(numbering)[:40]!r} is not one of {sorted(schema.STEP_NUMBERINGS)}")
    mb = meta.get("micro_batches")  # since version 4
    if mb is not None and not _whole(mb, 1, 2**31):
        raise _bad_meta(path, f"micro_batches {mb!r} is not an integer in [1, 2**31)")
    if meta.get("micro_batches_kept") not in (None, True, False):  # since version 6
        raise _bad_meta(path, f"micro_batches_kept {str(meta.get('micro_batches_kept'))[:40]!r} is not a bool")
    try:
        read_compile(meta.get("compile"))  # since version 5
    except ValueError as e:
        raise _bad_meta(path, f"compile {e}") from e
    params = meta.get("params")
    if params is None:
        return
    if not isinstance(params, list):
        raise _bad_meta(path, f"params is a {type(params).__name__}, not a list")
    for i, p in enumerate(params):
        _validate_param(p, i, path)


def _compatible(got: pl.DataType, want: pl.DataType) -> bool:
    if got == want or got == pl.Null:
        return True
    if want.is_integer():
        return got.is_integer()
    if want.is_float():
        return got.is_float() or got.is_integer()
    return False


def check_part_types(path: Path, cols: dict[str, pl.DataType], expected: dict[str, pl.DataType]) -> None:
    """Refuse a part whose columns do not have the schema's types (names are checked by the caller)."""
    wrong = [f"{c} is {cols[c]}, expected {t}" for c, t in expected.items() if c in cols
             and not _compatible(cols[c], t)]
    if wrong:
        raise BadInputError(f"Parquet part has wrong column types: {'; '.join(wrong[:3])}", path=path,
                            fix="trace/ must hold only parts written by the Recorder; move this file out")


# polars panics (a damaged page can trip an assertion in its decoder) derive from BaseException
READ_ERRORS = (Exception, pl.exceptions.PanicException)
_REQUIRED = ("step", "rank", "layer")  # keys of every row: a null here has no meaning


@contextlib.contextmanager
def quiet_native_stderr():
    """Hold back what native code writes to file descriptor 2 while a damaged part is read.

    A polars panic (a damaged page can trip an assertion in its Rust decoder) prints "thread
    panicked at ..." and a backtrace straight to fd 2, before Python sees the exception; the
    one-line ``Error:`` rule needs that text kept off the terminal. It is dropped.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield  # no real fd 2 (embedded interpreter): nothing to hold back
        return
    try:
        sink = os.open(os.devnull, os.O_WRONLY)  # NB: a temporary file cost ~1 ms per call, once per part
        try:
            os.dup2(sink, 2)
        finally:
            os.close(sink)
        try:
            yield
        finally:
            os.dup2(saved, 2)
    finally:
        os.close(saved)


def _decode(files: list[Path], columns: dict[str, pl.DataType], present=None) -> list[str]:
    """Decode and cast every column; return the key columns that hold nulls.

    `present` maps a part to its column names: parts of older versions lack the columns added
    since (``schema.COLUMNS_ADDED``), so parts are decoded in groups of the same columns.
    """
    groups: dict[tuple[str, ...], list[Path]] = {}
    for f in files:
        groups.setdefault(tuple(c for c in columns if present is None or c in present.get(f, columns)), []).append(f)
    nulls: set[str] = set()
    for have, group in groups.items():
        lf = pl.scan_parquet([str(f) for f in group], glob=False)
        with quiet_native_stderr():
            counts = lf.select([pl.col(c).cast(columns[c]).null_count() for c in have]).collect(engine="streaming")
        nulls.update(c for c in _REQUIRED if c in counts.columns and counts[c][0])
    return [c for c in _REQUIRED if c in nulls]


def _corrupt(part: Path, e: BaseException) -> BadInputError:
    return BadInputError(f"Parquet part's data is corrupt or out of range ({_detail(e)[:160]})", path=part,
                         fix=_PART_FIX)


def _detail(e: BaseException) -> str:
    if isinstance(e, pl.exceptions.PanicException):
        return "polars' Parquet decoder panicked on it"
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def check_parts_decode(files: list[Path], columns: dict[str, pl.DataType], present=None) -> None:
    """Decode every part once (streaming, bounded memory) and name a corrupt one.

    One pass over all parts; only when it fails is each part decoded alone, to name the bad one.
    Key columns (step, rank, layer) may hold no nulls.
    """
    if not files:
        return
    try:
        if not _decode(files, columns, present):
            return
        first_error: Exception | None = None
    except READ_ERRORS as e:  # polars raises ComputeError, InvalidOperationError, OSError, panics...
        first_error = e
    for f in files:
        try:
            nulls = _decode([f], columns, present)
        except READ_ERRORS as e:  # as above
            raise _corrupt(f, e) from e
        if nulls:
            raise BadInputError(f"Parquet part has null values in its key column(s) {nulls}", path=f,
                                fix=_PART_FIX)
    detail = _detail(first_error)
    raise BadInputError(f"the trace parts cannot be read together ({detail[:160]})", path=files[0].parent,
                        fix=_PART_FIX) from first_error


def check_part_ranks(streams: dict[tuple[int, int], list[tuple[int, Path]]],
                     present: dict[Path, frozenset[str]] | None = None) -> None:
    """Refuse a steps part whose rows name another rank than its file name (steps parts hold one
    row per step). `streams`: ``{(rank, writer): [(index, part)]}`` from the names; `present`: each
    part's columns (parts of older versions lack some), so that parts of one shape share a scan.

    One streaming scan per shape of part, grouped by file: the cost does not grow with the number
    of ranks (one scan per rank took 0.66 s for 1,000 ranks, where this takes 0.14 s).
    """
    if not streams:
        return
    owner = {str(f): (key, i, f) for key, parts in streams.items() for i, f in parts}
    shapes: dict[frozenset[str] | None, list[str]] = {}
    for name, (_, _, part) in owner.items():
        shapes.setdefault(present.get(part) if present else None, []).append(name)
    rank = pl.col("rank").cast(pl.Int64)
    try:
        with quiet_native_stderr():
            found = pl.concat([pl.scan_parquet(names, glob=False, include_file_paths="_part").group_by("_part")
                               .agg(lo=rank.min(), hi=rank.max()) for names in shapes.values()],
                              how="vertical").collect(engine="streaming")
    except READ_ERRORS:  # parts that cannot be scanned together (types differ, a page is damaged): one by one
        found = _part_ranks_apart(streams)
    wrong = sorted((owner[name], lo, hi) for name, lo, hi in found.iter_rows()
                   if lo is not None and not lo == hi == owner[name][0][0])
    if wrong:
        ((named, _), _, part), lo, hi = wrong[0]  # the first part in the order the parts are read
        held = f"rank {lo}" if lo == hi else f"ranks {lo}..{hi}"
        raise BadInputError(f"steps parts named rank {named} hold rows of {held}", path=part,
                            fix="a part was renamed or copied from another rank's files; move the parts that do not "
                                "belong out of trace/")


def _part_ranks_apart(streams: dict[tuple[int, int], list[tuple[int, Path]]]) -> pl.DataFrame:
    """(_part, lo, hi) of every part, one scan each: the slow way, taken when the parts cannot be read
    together (their types differ, or a page does not decode: that part is named)."""
    rows = []
    for parts in streams.values():
        for _, f in parts:
            try:
                with quiet_native_stderr():
                    r = pl.scan_parquet(str(f), glob=False).select(
                        lo=pl.col("rank").cast(pl.Int64).min(), hi=pl.col("rank").cast(pl.Int64).max()).collect()
            except READ_ERRORS as e:  # as above
                raise _corrupt(f, e) from e
            rows.append((str(f), r["lo"][0], r["hi"][0]))
    return pl.DataFrame(rows, schema={"_part": pl.String, "lo": pl.Int64, "hi": pl.Int64}, orient="row")

"""Map logs from other tools onto the recorder's step columns, so the same checks run on them.

One module per tool, each registering its reader with ``@register_log_importer`` (``_registry``,
where the order they are tried in is listed): ``hf_trainer`` (HF Trainer ``trainer_state.json``
or its output directory), ``csv_log`` (Lightning ``metrics.csv`` and generic CSV), ``jsonl``,
``deepspeed``, ``megatron`` and ``tensorboard`` (with the ``tensorboard`` extra). A file is
claimed by its name's prefix, then its suffix, then, for other text, by the first importer whose
``sniff`` is true of one of its lines; a directory by the file names or glob its importers search.
Every importer's values that its tool never writes are collected in ``_logcheck.Problems`` and
named by the report's ``implausible_trace`` check.
"""
from __future__ import annotations

import json
from pathlib import Path

from recorders import schema

from ...errors import BadInputError
from .._logcheck import LOG_PROBLEMS
from ..run import Run, progress_line
from . import csv_log, deepspeed, hf_trainer, jsonl, megatron, tensorboard  # noqa: F401 - each registers its importer
from ._common import HF_TRAINER_STATE, I64, LIGHTNING_METRICS, MAX_LINE, RUN_HINT, TFEVENTS_PREFIX, lines
from ._registry import LogImporter, importers, register_log_importer

__all__ = ["HF_TRAINER_STATE", "IMPORTED_LOGS", "LIGHTNING_METRICS", "LOG_PROBLEMS", "RUN_HINT", "TFEVENTS_PREFIX",
           "LogImporter", "import_dir", "import_file", "importers", "register_log_importer"]

# found by name in a directory, in this order (the importers' own order)
IMPORTED_LOGS = tuple(n for imp in importers() for n in imp.dir_names)
_MAX_STATES = 10_000  # trainer_state.json files weighed to find the newest; past that, by mtime only


def _global_step(path: Path) -> int:
    """A trainer_state.json's global_step (-1 when unreadable or absent), read to rank candidates."""
    try:
        if path.stat().st_size > MAX_LINE:
            return -1
        v = json.loads(path.read_bytes()).get("global_step")
    except (OSError, ValueError, AttributeError, RecursionError):
        return -1
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < I64 else -1


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
    """A directory without meta.json: the first importer, in order, that finds its files in it."""
    for imp in importers():
        for name in imp.dir_names:
            hits = sorted(path.rglob(name))
            if hits:
                newest = _newest(hits, by_step=imp.newest_by_step)
                progress_line(progress, f"importing {newest}")
                return import_file(newest)
        if imp.dir_glob and any(path.glob(imp.dir_glob)):
            return imp.read(path)
    for imp in importers():
        if imp.missing and (err := imp.missing(path)):
            raise err
    raise BadInputError(f"not a run directory: no {schema.META_FILE}", path=path, fix=RUN_HINT)


def import_file(path: Path, *, progress: bool = False) -> Run:
    """Detect the tool that wrote `path` and map its rows onto the step columns."""
    progress_line(progress, f"importing {path}")
    for imp in importers():
        if imp.prefix and path.name.startswith(imp.prefix):
            return imp.read(path.parent if imp.reads_dir else path)
    suffix = path.suffix.lower()
    for imp in importers():
        if suffix in imp.suffixes:
            return imp.read(path)
    if suffix == ".parquet":
        raise BadInputError("a single Parquet part is not a run", path=path,
                            fix="pass the run directory (the one holding meta.json and trace/)")
    try:
        text = [line for _, line in lines(path, errors="replace")]
    except OSError as e:
        raise BadInputError(f"cannot read ({e.strerror})", path=path, fix=RUN_HINT) from e
    for imp in importers():
        if imp.sniff and any(imp.sniff(x) for x in text):
            return imp.read(path, text)
    raise BadInputError("unrecognised file: not a run directory, HF/Lightning/DeepSpeed/Megatron log, CSV or JSONL",
                        path=path, fix=RUN_HINT)

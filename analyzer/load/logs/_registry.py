"""The log importer registry: one importer per module, registered at its definition.

``@register_log_importer("deepspeed_log", order=40, sniff=...)`` on the function that reads the
file is the whole wiring of a new importer: ``import_file`` and ``import_dir`` (``__init__``) walk
``importers()``, which is sorted by ``order`` (unique), so the order files are tried in is the
numbers below, never the order modules were imported in:

====== ==================== ==============================================================
order  format               claims
====== ==================== ==============================================================
10     hf_trainer_state     ``*.json``; ``trainer_state.json`` in a directory (the newest)
20     csv                  ``*.csv``; ``metrics.csv`` in a directory (Lightning)
30     jsonl                ``*.jsonl``, ``*.ndjson``
40     deepspeed_log        other text whose lines match its ``sniff``
50     megatron_log         other text whose lines match its ``sniff``
60     tensorboard          ``events.out.tfevents*`` files and directories holding them
====== ==================== ==============================================================
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

__all__ = ["LogImporter", "importers", "register_log_importer"]

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class LogImporter:
    """How one tool's logs are recognised, and the function that reads them into a ``Run``.

    ``read(path)`` reads a file (or, with ``reads_dir``, the directory holding the files); an
    importer with a ``sniff`` reads text logs: ``read(path, lines)`` is called when ``sniff`` is true
    of any line of a file no suffix claimed.
    """

    format: str
    order: int
    read: Callable
    suffixes: tuple[str, ...] = ()  # lower-case file name endings it reads (".csv")
    prefix: str = ""  # file names starting with this are its own, whatever their suffix
    dir_names: tuple[str, ...] = ()  # file names searched for (recursively) in a directory; the newest is read
    dir_glob: str = ""  # a directory holding a match is read whole (read(directory))
    newest_by_step: bool = False  # rank the dir_names hits by their global_step before their mtime
    reads_dir: bool = False  # read() takes the directory that holds the matched file
    sniff: Callable[[str], bool] | None = None  # a text log: a line only this tool writes
    missing: Callable[[Path], Exception | None] | None = None  # a directory of this tool's without its log


_IMPORTERS: dict[str, LogImporter] = {}


def register_log_importer(fmt: str, *, order: int, **how) -> Callable[[F], F]:
    """Register the decorated function as the importer of `fmt`, tried at `order` (unique)."""
    def deco(fn: F) -> F:
        clash = [i.format for i in _IMPORTERS.values() if i.order == order and i.format != fmt]
        if fmt in _IMPORTERS and _IMPORTERS[fmt].read is not fn or clash:
            raise ValueError(f"log importer {fmt!r} at order {order}: already registered ({clash or fmt})")
        _IMPORTERS[fmt] = LogImporter(fmt, order, fn, **how)
        return fn
    return deco


def importers() -> list[LogImporter]:
    """Every registered importer, in ``order``."""
    return sorted(_IMPORTERS.values(), key=lambda i: i.order)

"""JSON Lines logs (``*.jsonl``, ``*.ndjson``): one object per line with ``step`` and any of
``loss``, ``scale`` (or ``loss_scale``), ``grad_norm``, ``lr``, ``skipped``."""
from __future__ import annotations

import json
from pathlib import Path

from ...errors import BadInputError
from .._limits import NumberTooLong, json_loads, safe_strings
from .._logcheck import Problems
from ..run import Run
from ._common import generic_rows, lines, to_run
from ._registry import register_log_importer

__all__ = ["import_jsonl"]


@register_log_importer("jsonl", order=30, suffixes=(".jsonl", ".ndjson"))
def import_jsonl(path: Path) -> Run:
    records, bad = [], Problems()
    for i, line in lines(path):
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
    rows = generic_rows([(w, r) for w, r in records if isinstance(r, dict)], path, bad)
    return to_run(path, "jsonl", rows, bad=bad)

"""CSV logs: Lightning ``CSVLogger``'s ``metrics.csv`` (``step`` plus a loss column such as
``train_loss_step``, optional ``lr-*`` and ``grad_*norm*`` columns) and generic CSV files with
``step`` and any of ``loss``, ``scale`` (or ``loss_scale``), ``grad_norm``, ``lr``, ``skipped``.

Every check here is linear in the file: the header's repeated names are counted once (a header
of 200,000 columns costs what reading it costs).
"""
from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

from ...errors import BadInputError
from .._logcheck import Problems, short
from ..run import Run
from ._common import LIGHTNING_METRICS, RUN_HINT, generic_rows, to_run
from ._registry import register_log_importer

__all__ = ["import_csv"]

@register_log_importer("csv", order=20, suffixes=(".csv",), dir_names=(LIGHTNING_METRICS,))
def import_csv(path: Path) -> Run:
    bad = Problems()
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames or "step" not in reader.fieldnames:
                cols = str(reader.fieldnames)[:200]
                raise BadInputError(f"CSV without a 'step' column (columns: {cols})", path=path,
                                    fix="add a 'step' column, or pass a Lightning CSVLogger metrics.csv")
            header = list(reader.fieldnames)
            for name, n in sorted((c, n) for c, n in Counter(header).items() if n > 1):
                bad.add("header", f"column {short(name)} appears {n} times (the last one is read)")
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
    rows = generic_rows(records, path, bad, shape=shape)
    if fmt == "lightning_csv":  # Lightning logs _step and _epoch rows separately; keep one per step
        rows = rows.unique("step", keep="first")
    return to_run(path, fmt, rows, bad=bad)

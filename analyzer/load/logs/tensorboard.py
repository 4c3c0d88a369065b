"""TensorBoard event files (``events.out.tfevents*``), when the ``tensorboard`` extra is installed:
the scalars of every tag, by step, mapped like a generic log (a tag's last path part is its column)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import BadInputError
from .._logcheck import Problems
from ..run import Run
from ._common import RUN_HINT, TFEVENTS_PREFIX, generic_rows, to_run
from ._registry import register_log_importer

__all__ = ["import_tensorboard"]


@register_log_importer("tensorboard", order=60, prefix=TFEVENTS_PREFIX, reads_dir=True,
                       dir_glob=f"**/{TFEVENTS_PREFIX}*")
def import_tensorboard(path: Path) -> Run:
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
    rows = generic_rows([(f"step {s}", r) for s, r in by_step.items()], path, bad)
    return to_run(path, "tensorboard", rows, bad=bad)

"""HF Trainer ``trainer_state.json``: its ``log_history`` entries (``loss``, ``grad_norm``,
``learning_rate``, ``step``); in a directory, the newest ``trainer_state.json`` (the highest
``global_step``, in ``checkpoint-N/`` or beside them).

A NaN/Inf ``grad_norm`` is a step with non-finite gradients. NB: HF's ``logging_nan_inf_filter``
(on by default) logs a NaN/Inf loss as the running mean (0.0 right after a log), so at a step whose
``grad_norm`` is NaN/Inf the logged loss is not trusted: it is read as unknown (null) and the row is
marked ``loss_filtered``.
"""
from __future__ import annotations

from pathlib import Path

import polars as pl

from ...errors import BadInputError
from .._logcheck import Problems
from ..run import Run
from ._common import HF_TRAINER_STATE, RUN_HINT, generic_rows, read_json, to_run
from ._registry import register_log_importer

__all__ = ["import_hf"]


def _output_dir_without_state(path: Path) -> Exception | None:
    if (path / "training_args.bin").exists() or any(path.glob("checkpoint-*")):
        return BadInputError("an HF Trainer output directory without a trainer_state.json", path=path,
                             fix="HF writes trainer_state.json into each checkpoint-N/ (save_strategy='steps') and "
                                 "with trainer.save_state(); or record the run with the amp-autopsy callback")
    return None


@register_log_importer("hf_trainer_state", order=10, suffixes=(".json",), dir_names=(HF_TRAINER_STATE,),
                       newest_by_step=True, missing=_output_dir_without_state)
def import_hf(path: Path) -> Run:
    state = read_json(path)
    if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
        raise BadInputError("JSON without a 'log_history' list: not an HF trainer_state.json",
                            path=path, fix=RUN_HINT)
    # only "loss": the end-of-training summary entry carries "train_loss" (a run average)
    bad = Problems()
    rows = generic_rows([(f"log_history[{i}]", e) for i, e in enumerate(state["log_history"]) if isinstance(e, dict)],
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
    return to_run(path, "hf_trainer_state", rows, notes=notes, bad=bad)

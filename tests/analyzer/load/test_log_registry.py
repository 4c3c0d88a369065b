"""The log importer registry: a new importer is one decorated function, tried in its ``order``."""
from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from analyzer.load.logs import IMPORTED_LOGS, importers, register_log_importer
from analyzer.load.logs._common import to_run
from analyzer.load.logs._registry import _IMPORTERS
from analyzer.load._logcheck import Problems, number_cell

from .test_logs import implausible, report, write


@pytest.fixture
def fairseq():
    """A throwaway importer of a made-up ``| epoch N | step S | loss L`` text log, registered for one test."""
    def sniff(line: str) -> bool:
        return line.startswith("| epoch ") and "| loss " in line

    @register_log_importer("fairseq_log", order=45, sniff=sniff)
    def import_fairseq(path: Path, lines: list[str]):
        rows, bad = [], Problems()
        for i, line in enumerate(lines, 1):
            fields = dict(f.strip().split(" ", 1) for f in line.strip("| ").split("|") if " " in f.strip())
            rows.append({"step": int(fields["step"]), "rank": 0,
                         "loss": number_cell(fields["loss"], f"line {i}", "loss", bad)})
        return to_run(path, "fairseq_log", pl.DataFrame(rows), amp_dtype="float16", bad=bad)

    yield import_fairseq
    del _IMPORTERS["fairseq_log"]


def test_the_importers_are_tried_in_their_documented_order():
    assert [(i.format, i.order) for i in importers()] == [
        ("hf_trainer_state", 10), ("csv", 20), ("jsonl", 30), ("deepspeed_log", 40), ("megatron_log", 50),
        ("tensorboard", 60)]
    assert IMPORTED_LOGS == ("trainer_state.json", "metrics.csv")


def test_an_importer_registered_in_a_test_reads_its_log_through_the_report(tmp_path, fairseq):
    assert [i.format for i in importers()][3:6] == ["deepspeed_log", "fairseq_log", "megatron_log"]
    text = "".join(f"| epoch 1 | step {s} | loss {3 - s / 10}\n" for s in range(1, 6)) + "| epoch 1 | step 6 | loss ?\n"
    code, out = report(write(tmp_path, "train.log", text))
    assert code == 0 and out["source_format"] == "fairseq_log" and out["steps"]["count"] == 6
    assert implausible(out)["evidence"]["log_examples"] == ["line 6: loss '?' is not a number"]


def test_a_second_importer_at_a_taken_order_is_refused(fairseq):
    with pytest.raises(ValueError, match="order 45"):
        register_log_importer("other_log", order=45, sniff=lambda line: False)(lambda path, lines: None)
    assert "other_log" not in _IMPORTERS

"""Foreign logs (analyzer.load.logs): values their tools never write are named, never read in silence.

Each damaged log is read as far as it can be and the report's ``implausible_trace`` warning names
every value that was not one its tool writes (the line, the column, the value); a step or
iteration number that is not an integer is refused with one ``Error:`` line.
"""
from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.cli import main

_LIGHTNING_HEADER = "epoch,lr-Adam,step,train_loss_step,train_loss_epoch\n"


def report(path) -> tuple[int, dict | str]:
    res = CliRunner().invoke(main, ["report", str(path), "--json"])
    if res.exit_code != 0:
        assert "Traceback" not in res.output
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), res.stderr
        return res.exit_code, lines[0]
    return 0, json.loads(res.stdout)


def implausible(out: dict) -> dict | None:
    found = [f for f in out["findings"] if f["check"] == "implausible_trace"]
    assert len(found) <= 1 and not [f for f in out["findings"] if f["check"] == "check_failed"]
    return found[0] if found else None


def write(tmp_path, name: str, text: str):
    p = tmp_path / name
    p.write_bytes(text.encode("utf-8", "surrogatepass"))
    return p


def _lightning(rows: list[str]) -> str:
    """A Lightning CSVLogger metrics.csv: step rows with train_loss_step, one epoch row per 4 steps."""
    return _LIGHTNING_HEADER + "".join(r + "\n" for r in rows)


_SOUND = [f"0,0.001,{s},{2.0 - s / 10:.3f}," for s in range(8)] + ["0,,7,,1.7"]


def test_a_sound_lightning_csv_gives_no_implausible_warning(tmp_path):
    code, out = report(write(tmp_path, "metrics.csv", _lightning(_SOUND)))
    assert code == 0 and out["source_format"] == "lightning_csv" and implausible(out) is None


@pytest.mark.parametrize("row, named", [
    ("0,0.001,3,1.5,,9,9", "line 5: 7 field(s), the header has 5"),    # two extra fields
    ("0,0.001,3", "line 5: 3 field(s), the header has 5"),              # a line cut short
    ("0,0.001,3,\x001.5,", "line 5: train_loss_step '\\x001.5' is not a number"),
    ("0,0.001,3,1.5.2,", "line 5: train_loss_step '1.5.2' is not a number"),
    ("0,fast,3,1.5,", "line 5: lr-Adam 'fast' is not a number"),
    ("0,0.001,three,1.5,", "line 5: step 'three' is not a number"),
])
def test_each_malformed_lightning_row_is_named_in_a_warning_and_the_rest_is_read(tmp_path, row, named):
    rows = list(_SOUND)
    rows[3] = row  # line 5: the header is line 1, the rows 2.. ; step 3's row
    code, out = report(write(tmp_path, "metrics.csv", _lightning(rows)))
    assert code == 0, out
    f = implausible(out)
    assert f is not None and f["severity"] == "warning", out["findings"]
    assert f["evidence"]["log_problems"] == 1 and f["evidence"]["log_examples"] == [named]
    assert f"1 malformed value(s) in the lightning_csv log: {named}" in f["message"]
    assert out["steps"]["count"] >= 7  # the sound rows are still analysed


def test_a_header_naming_a_column_twice_is_named(tmp_path):
    text = "step,loss,loss\n" + "".join(f"{s},{1 + s},{2 + s}\n" for s in range(5))
    code, out = report(write(tmp_path, "log.csv", text))
    assert code == 0
    assert implausible(out)["evidence"]["log_examples"] == ["header: column 'loss' appears 2 times (the last one "
                                                            "is read)"]


def test_a_csv_whose_every_loss_is_junk_is_refused_naming_the_first(tmp_path):
    p = write(tmp_path, "metrics.csv", "step,loss\n1,abc\n2,def\n")
    code, line = report(p)
    assert code == 1
    assert line == (f"Error: {p}: no rows with both 'step' and a loss column (loss, train_loss_step, train_loss, "
                    "train/loss, ...) (line 2: loss 'abc' is not a number) (log the training loss with its step, "
                    "e.g. a 'step,loss' CSV)")


def test_more_problems_than_examples_are_counted(tmp_path):
    text = "step,loss\n" + "".join(f"{s},x{s}\n" for s in range(20)) + "20,1.0\n"
    f = implausible(report(write(tmp_path, "log.csv", text))[1])
    assert f["evidence"]["log_problems"] == 20 and len(f["evidence"]["log_examples"]) == 8
    assert f["message"].count("is not a number") == 8 and "and 12 more" in f["message"]


def test_junk_in_an_hf_trainer_state_and_a_jsonl_log_is_named(tmp_path):
    hist = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": "2.1x"}, {"step": 3, "loss": True, "grad_norm": "big"},
            {"step": 4, "loss": 1.8}]
    f = implausible(report(write(tmp_path, "trainer_state.json", json.dumps({"log_history": hist})))[1])
    assert f["evidence"]["log_examples"] == ["log_history[1]: loss '2.1x' is not a number",
                                             "log_history[2]: loss 'True' is not a number"]
    lines = [json.dumps({"step": 1, "loss": 2.0, "lr": "warm"}), json.dumps({"step": 2, "loss": 1.9})]
    f = implausible(report(write(tmp_path, "log.jsonl", "\n".join(lines) + "\n"))[1])
    assert f["evidence"]["log_examples"] == ["line 1: lr 'warm' is not a number"]


_DS_OVERFLOW = "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {}, reducing to {}\n"


@pytest.mark.parametrize("attempted, reduced, named", [
    ("...", "...", ["line 2: attempted loss scale '...' is not a positive finite number",
                    "line 2: reduced loss scale '...' is not a positive finite number"]),
    ("nan", "32768", ["line 2: attempted loss scale 'nan' is not a positive finite number"]),
    ("65536", "inf", ["line 2: reduced loss scale 'inf' is not a positive finite number"]),
    ("65536", "-1", ["line 2: reduced loss scale '-1' is not a positive finite number"]),
    ("65536", "0", ["line 2: reduced loss scale '0' is not a positive finite number"]),
])
def test_a_deepspeed_overflow_line_with_an_unreadable_scale_is_read_and_its_scale_named(tmp_path, attempted,
                                                                                        reduced, named):
    text = ("steps: 1 loss: 2.5\n" + _DS_OVERFLOW.format(attempted, reduced)
            + "".join(f"steps: {s} loss: {2.5 - s / 10}\n" for s in range(3, 8)))
    code, out = report(write(tmp_path, "train.log", text))
    assert code == 0 and out["source_format"] == "deepspeed_log"
    assert out["steps"]["skipped"] == 1  # the overflow line is still one skipped step
    assert implausible(out)["evidence"]["log_examples"] == named


def test_a_sound_deepspeed_log_gives_no_implausible_warning(tmp_path):
    text = "steps: 1 loss: 2.5\n" + _DS_OVERFLOW.format(65536, 32768) + "steps: 3 loss: 2.4\nsteps: 4 loss: nan\n"
    code, out = report(write(tmp_path, "train.log", text))
    assert code == 0 and implausible(out) is None  # a nan loss is what DeepSpeed prints, not damage


def test_a_deepspeed_loss_that_is_not_a_number_is_named(tmp_path):
    text = "steps: 1 loss: 2.5\nsteps: 2 loss: lots\nsteps: 3 loss: 2.3\n"
    assert implausible(report(write(tmp_path, "train.log", text))[1])["evidence"]["log_examples"] == [
        "line 2: loss 'lots' is not a number"]


def _megatron(counts: list[tuple[str, str]], scale="65536.0") -> str:
    return "".join(f" iteration {10 * (i + 1)}/ 1000 | consumed samples: {80 * (i + 1)} | lm loss: {3 - i / 10:.4E} | "
                   f"loss scale: {scale} | grad norm: 1.2 | number of skipped iterations: {sk} | "
                   f"number of nan iterations: {nan} |\n" for i, (sk, nan) in enumerate(counts))


def test_a_sound_megatron_log_gives_no_implausible_warning(tmp_path):
    code, out = report(write(tmp_path, "train.log", _megatron([("0", "0"), ("2", "0"), ("0", "0")])))
    assert code == 0 and out["source_format"] == "megatron_log" and implausible(out) is None


@pytest.mark.parametrize("skipped, nan, named", [
    ("inf", "0", "line 2: number of skipped iterations 'inf' is not a whole count of the interval's 10 iteration(s) "
                 "(read as 0)"),
    ("0", "nan", "line 2: number of nan iterations 'nan' is not a whole count of the interval's 10 iteration(s) "
                 "(read as 0)"),
    ("0", "1e999", "line 2: number of nan iterations '1e999' is not a whole count of the interval's 10 "
                   "iteration(s) (read as 0)"),
    ("2.5", "0", "line 2: number of skipped iterations '2.5' is not a whole count of the interval's 10 "
                 "iteration(s) (read as 0)"),
    ("11", "0", "line 2: number of skipped iterations '11' is not a whole count of the interval's 10 "
                "iteration(s) (read as 0)"),
    ("-1", "0", "line 2: number of skipped iterations '-1' is not a whole count of the interval's 10 "
                "iteration(s) (read as 0)"),
])
def test_megatron_iteration_counts_that_are_not_counts_are_named_and_not_read_as_a_nan_loss(tmp_path, skipped,
                                                                                            nan, named):
    code, out = report(write(tmp_path, "train.log", _megatron([("0", "0"), (skipped, nan), ("0", "0")])))
    assert code == 0
    assert implausible(out)["evidence"]["log_examples"] == [named]
    # a count of 'nan' is no evidence of a NaN loss: no non-finite loss is made up from it
    assert out["steps"]["nonfinite_loss"] == 0 and out["steps"]["skipped"] == 0


def test_a_megatron_loss_scale_of_zero_is_named(tmp_path):
    f = implausible(report(write(tmp_path, "train.log", _megatron([("0", "0"), ("0", "0")], scale="0.0")))[1])
    assert f["evidence"]["log_examples"] == ["line 1: loss scale '0.0' is not a positive finite number",
                                             "line 2: loss scale '0.0' is not a positive finite number"]


@pytest.mark.parametrize("it", ["nan", "inf", "1e999", "-5", "2.5"])
def test_a_megatron_iteration_number_that_is_not_an_integer_is_refused(tmp_path, it):
    p = write(tmp_path, "train.log", _megatron([("0", "0")]) + f" iteration {it}/ 1000 | lm loss: 1.0 |\n")
    code, line = report(p)
    assert code == 1
    assert line.startswith(f"Error: {p}: line 2: iteration '{it}' is not an integer in [0, 9223372036854775808) "
                           "(the log is damaged or foreign; ")


# -- hypothesis: any cells, any field counts -----------------------------------------------------
_cell = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr),
                  st.integers(-10**6, 10**6).map(str), st.just(""),
                  st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters=',"\r\n'), max_size=6))


def _is_number(cell: str) -> bool:
    try:
        float(cell)
        return True
    except ValueError:
        return False


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(_cell, st.integers(0, 3)), min_size=1, max_size=12))
def test_any_lightning_cells_are_read_or_named_never_dropped_in_silence(tmp_path_factory, rows):
    """Row i is step i; its loss cell is drawn; `extra` fields 0..3 are appended (1 = the sound shape)."""
    lines, problems, readable = [], 0, 0
    for i, (loss, extra) in enumerate(rows):
        cells = [str(i), loss] + ["9"] * (extra - 1) if extra else [str(i)]
        lines.append(",".join(cells))
        shape_bad = extra != 1
        loss_cell = loss if extra else None
        junk = loss_cell not in (None, "") and not _is_number(loss_cell)
        problems += shape_bad + junk
        readable += loss_cell not in (None, "") and not junk
    path = tmp_path_factory.mktemp("csv") / "metrics.csv"
    path.write_text("step,train_loss_step\n" + "\n".join(lines) + "\n")
    code, out = report(path)
    if not readable:
        assert code == 1 and "no rows with both 'step' and a loss column" in out
        return
    assert code == 0, out
    assert out["steps"]["count"] == readable
    f = implausible(out)
    assert (f["evidence"]["log_problems"] if f else 0) == problems


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.lists(st.tuples(st.sampled_from(["0", "1", "3", "10", "11", "-1", "2.5", "nan", "inf", "1e999", "x"]),
                                 st.sampled_from(["0", "1", "10", "nan", "-0", "1e2", "abc"])), min_size=1, max_size=6))
def test_any_megatron_counts_are_read_as_counts_or_named(tmp_path_factory, tokens):
    path = tmp_path_factory.mktemp("meg") / "train.log"
    path.write_text(_megatron(tokens))
    code, out = report(path)
    assert code == 0, out

    def ok(tok: str) -> bool:
        x = float(tok) if _is_number(tok) else math.nan
        return math.isfinite(x) and x == int(x) and 0 <= x <= 10

    expected = sum((not ok(sk)) + (not ok(nan)) for sk, nan in tokens)
    f = implausible(out)
    assert (f["evidence"]["log_problems"] if f else 0) == expected
    nan_steps = sum(ok(nan) and float(nan) > 0 for _, nan in tokens)
    assert out["steps"]["nonfinite_loss"] == nan_steps


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scales=st.lists(st.tuples(*[st.one_of(st.sampled_from(["65536", "1.5e4", "0", "-2", "nan", "inf", "...", "x",
                                                                "", "1e999"]),
                                             st.floats(allow_nan=True, allow_infinity=True).map(repr))] * 2),
                       min_size=1, max_size=5))
def test_any_deepspeed_overflow_scales_are_read_or_named(tmp_path_factory, scales):
    text = "steps: 0 loss: 2.0\n" + "".join(_DS_OVERFLOW.format(a, r) for a, r in scales)
    path = tmp_path_factory.mktemp("ds") / "train.log"
    path.write_text(text)
    code, out = report(path)
    assert code == 0, out
    assert out["steps"]["skipped"] == len(scales)  # every overflow line is a skipped step, whatever its scale

    def ok(tok: str) -> bool:
        return _is_number(tok) and math.isfinite(float(tok)) and float(tok) > 0

    f = implausible(out)
    assert (f["evidence"]["log_problems"] if f else 0) == sum((not ok(a)) + (not ok(r)) for a, r in scales)

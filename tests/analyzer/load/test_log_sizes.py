"""Every log importer is linear in its input: a line of 10^6 characters (columns, spaces, digits)
is read in seconds, with the defect it carries named or refused in one ``Error:`` line.

The bound is generous (the machine is shared); the quadratic header check and the backtracking
DeepSpeed/Megatron patterns these guard against took minutes on the same inputs.
"""
from __future__ import annotations

import json
import re
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .test_logs import implausible, report, write

N = 10**6
BOUND_S = 20.0  # seconds, for one report of one file; bench/log_parse_time.py records the real times


def _timed(path):
    t = time.perf_counter()
    code, out = report(path)
    return code, out, time.perf_counter() - t


def test_a_csv_header_of_200k_repeated_columns_is_read_in_seconds_and_the_repeats_named(tmp_path):
    header = ",".join(["step", "loss"] + [f"c{i % 1000}" for i in range(200_000)])
    code, out, s = _timed(write(tmp_path, "metrics.csv", header + "\n1,2.0\n2,1.5\n"))
    assert s < BOUND_S and code == 0, (s, out)
    f = implausible(out)
    assert f["evidence"]["log_problems"] == 1000 + 2  # the 1000 repeated names, the two short rows
    assert f["evidence"]["log_examples"][0] == "header: column 'c0' appears 200 times (the last one is read)"


def test_a_csv_header_of_a_million_columns_is_read_in_seconds(tmp_path):
    header = ",".join(["step", "loss"] + [str(i) for i in range(N)])
    code, out, s = _timed(write(tmp_path, "log.csv", header + "\n1,2.0\n"))
    assert s < BOUND_S and code == 0, (s, out)
    assert implausible(out)["evidence"]["log_examples"] == [f"line 2: 2 field(s), the header has {N + 2}"]


def test_a_csv_cell_of_a_million_digits_is_one_error_line(tmp_path):
    code, line, s = _timed(write(tmp_path, "log.csv", "step,loss\n1," + "9" * N + "\n"))
    assert s < BOUND_S and code == 1 and "malformed CSV (field larger than field limit" in line


@pytest.mark.parametrize("fill", [" " * N, "9" * N, "x" * N])
def test_a_deepspeed_overflow_line_of_a_million_characters_is_read_in_seconds_and_named(tmp_path, fill):
    text = ("steps: 1 loss: 2.0\n[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: x" + fill
            + "\nsteps: 3 loss: 1.0\n")
    code, out, s = _timed(write(tmp_path, "train.log", text))
    assert s < BOUND_S and code == 0, (s, out)
    assert out["steps"]["skipped"] == 1  # the overflow line is still a skipped step
    first = implausible(out)["evidence"]["log_examples"][0]
    assert first.startswith("line 2: overflow line without ', reducing to Y' after the attempted scale 'x")


def test_a_deepspeed_overflow_line_without_its_scale_is_a_skipped_step_and_named(tmp_path):
    text = "steps: 1 loss: 2.0\n[deepspeed] OVERFLOW! Rank 0 Skipping step.\nsteps: 3 loss: 1.0\n"
    code, out = report(write(tmp_path, "train.log", text))
    assert code == 0 and out["steps"]["skipped"] == 1
    assert implausible(out)["evidence"]["log_examples"] == [
        "line 2: overflow line without 'Attempted loss scale:' (scale unknown)"]


def test_a_deepspeed_scale_that_is_two_words_is_named_not_dropped(tmp_path):
    text = ("steps: 1 loss: 2.0\n[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536 x, "
            "reducing to 32768\nsteps: 3 loss: 1.0\n")
    code, out = report(write(tmp_path, "train.log", text))
    assert code == 0 and out["steps"]["skipped"] == 1
    assert implausible(out)["evidence"]["log_examples"] == [
        "line 2: attempted loss scale '65536 x' is not a positive finite number"]


@pytest.mark.parametrize("fill", [" " * N, "a" * N, "1" * N])
def test_a_megatron_line_of_a_million_characters_is_read_in_seconds(tmp_path, fill):
    text = (f"iteration 1/ 10 | lm loss: 2.0 | a{fill} |\n"
            "iteration 2/ 10 | lm loss: 1.5 | loss scale: 0 |\n")
    code, out, s = _timed(write(tmp_path, "train.log", text))
    assert s < BOUND_S and code == 0 and out["source_format"] == "megatron_log", (s, out)
    assert implausible(out)["evidence"]["log_examples"] == ["line 2: loss scale '0' is not a positive finite number"]


def test_a_megatron_iteration_of_a_million_digits_is_one_error_line(tmp_path):
    code, line, s = _timed(write(tmp_path, "train.log", "iteration " + "1" * N + "/ 10 | lm loss: 2.0 |\n"))
    assert s < BOUND_S and code == 1 and "iteration '1111" in line and "is not an integer" in line


def test_a_jsonl_number_of_a_million_digits_is_one_error_line(tmp_path):
    code, line, s = _timed(write(tmp_path, "log.jsonl", '{"step": 1, "loss": ' + "9" * N + '}\n'))
    assert s < BOUND_S and code == 1 and line.startswith("Error: ") and ": line 1 " in line, (s, line)


def test_a_jsonl_line_of_a_million_spaces_is_read_in_seconds(tmp_path):
    text = '{"step": 1, "loss": ' + " " * N + '"x"}\n{"step": 2, "loss": 1.0}\n'
    code, out, s = _timed(write(tmp_path, "log.jsonl", text))
    assert s < BOUND_S and code == 0, (s, out)
    assert implausible(out)["evidence"]["log_examples"] == ["line 1: loss 'x' is not a number"]


def test_an_hf_state_with_a_million_character_key_is_read_in_seconds(tmp_path):
    hist = [{"step": 1, "loss": 2.0, "x" * N: 1}, {"step": 2, "loss": "a" * N}]
    code, out, s = _timed(write(tmp_path, "trainer_state.json", json.dumps({"log_history": hist})))
    assert s < BOUND_S and code == 0, (s, out)
    assert implausible(out)["evidence"]["log_examples"] == [f"log_history[1]: loss {'a' * 40!r} is not a number"]


_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"),
                max_size=60)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tail=_TEXT)
def test_any_text_after_a_deepspeed_overflow_is_a_skipped_step_read_or_named(tmp_path_factory, tail):
    text = f"steps: 1 loss: 2.0\n[deepspeed] OVERFLOW! Rank 0 Skipping step.{tail}\nsteps: 3 loss: 1.0\n"
    path = tmp_path_factory.mktemp("ds") / "train.log"
    path.write_text(text, encoding="utf-8")
    code, out = report(path)
    assert code == 0 and out["steps"]["skipped"] == 1, out  # never dropped, whatever follows
    sound = bool(re.fullmatch(r"\s*Attempted loss scale:\s*(\S+)\s*,\s*reducing to\s*(\S+)\s*", tail))
    if not sound:  # a line not as DeepSpeed prints it: its problem is named
        assert implausible(out)["evidence"]["log_examples"][0].startswith("line 2: ")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.lists(_TEXT.filter(lambda s: "|" not in s), max_size=4))
def test_any_megatron_fields_give_a_report_or_one_error_line(tmp_path_factory, fields):
    text = "iteration 1/ 10 | lm loss: 2.0 |" + "|".join(fields) + "|\niteration 2/ 10 | lm loss: 1.5 |\n"
    path = tmp_path_factory.mktemp("meg") / "train.log"
    path.write_text(text, encoding="utf-8")
    code, out = report(path)
    assert code in (0, 1), out
    if code == 0:
        assert out["source_format"] == "megatron_log" and out["steps"]["count"] == 2


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.lists(st.sampled_from(["step", "loss", "a", "b", "lr", ""]), min_size=1, max_size=30))
def test_any_repeated_csv_header_names_are_counted_exactly(tmp_path_factory, header):
    header = ["step", "loss", *header]
    path = tmp_path_factory.mktemp("csv") / "log.csv"
    path.write_text(",".join(header) + "\n" + ",".join(["1", "2.0"] + ["0"] * (len(header) - 2)) + "\n")
    code, out = report(path)
    assert code == 0, out
    repeats = sorted((c, header.count(c)) for c in set(header) if header.count(c) > 1)
    named = [e for e in (implausible(out) or {"evidence": {"log_examples": []}})["evidence"]["log_examples"]
             if e.startswith("header: ")]
    assert named == [f"header: column {c!r} appears {n} times (the last one is read)" for c, n in repeats][:8]

"""A path given to the wrong command, or a file that is no torch file: one ``Error:`` line saying what to run.

Real ``analyzer`` commands (CliRunner) on a real recorded run, its snapshot, and real broken files.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main
from recorders import Recorder, schema
from tests.recorders.models import batches, build_mlp, mse_loss, sgd

REFS = {"factory": "tests.recorders.models:build_mlp", "loss_fn": "tests.recorders.models:mse_loss"}


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory) -> tuple[Path, Path]:
    """A real run whose step 2 has a NaN batch: a manual snapshot at step 1, a nonfinite_loss one at 2."""
    run = tmp_path_factory.mktemp("which") / "run"
    model = build_mlp()
    opt = sgd(model)
    with Recorder(run, model, **REFS, optimizer=opt) as rec:
        for step, batch in enumerate(batches(4)):
            if step == 2:
                batch["x"][0, 0] = float("nan")
            rec.begin_step(step, batch)
            loss = mse_loss(model, batch)
            loss.backward()
            rec.end_step(loss)
            if step == 1:
                rec.snapshot()  # manual: the user's own checkpoint, never "the first failing snapshot"
            opt.step()
            opt.zero_grad()
    (failing,) = (run / schema.SNAPSHOT_DIR).glob("*nonfinite_loss.pt")
    return run, failing


def _error_line(result, code: int = 1) -> str:
    assert result.exit_code == code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_replay_of_a_run_directory_names_its_first_failing_snapshot_and_autopsy(failing_run):
    run, failing = failing_run
    for args in (("replay", run), ("replay", run, "--show"), ("replay", run, "--json")):
        assert _error_line(_cli(*args)) == (
            f"Error: {run}: is a run directory; replay takes one snapshot file, and this run's first failing "
            f"snapshot is {failing} (analyzer replay {failing}; for the whole answer (report, replays, fixes): "
            f"analyzer autopsy {run})")


def test_replay_of_a_snapshots_directory_names_the_snapshot_and_the_run(failing_run):
    run, failing = failing_run
    line = _error_line(_cli("replay", run / schema.SNAPSHOT_DIR))
    assert line.endswith(f"(analyzer replay {failing}; analyzer autopsy {run} picks and replays them)")


def test_replay_of_another_directory_says_it_takes_a_snapshot_file(tmp_path):
    assert _error_line(_cli("replay", tmp_path)) == (
        f"Error: {tmp_path}: is a directory; replay takes one snapshot file (RUN_DIR/snapshots/*.pt) (pass a .pt "
        "file written by the recorder, or run analyzer autopsy RUN_DIR)")


@pytest.mark.parametrize("command", ["report", "autopsy"])
def test_report_and_autopsy_of_a_snapshot_name_replay_and_the_run_directory(failing_run, command):
    run, failing = failing_run
    assert _error_line(_cli(command, failing)) == (
        f"Error: {failing}: is a snapshot of one failing step, not a run (analyzer replay {failing}; report and "
        f"autopsy read its run directory: analyzer autopsy {run})")


@pytest.mark.parametrize("command", ["report", "autopsy"])
def test_report_of_a_checkpoint_names_inspect_and_replay(tmp_path, command):
    ckpt = tmp_path / "model.pt"
    torch.save(build_mlp().state_dict(), ckpt)
    assert _error_line(_cli(command, ckpt)) == (
        f"Error: {ckpt}: is a torch file, not a run directory or a training log (analyzer replay {ckpt} for a "
        f"recorder snapshot, analyzer inspect {ckpt} for a checkpoint)")


def test_a_python_file_given_to_replay_is_not_a_torch_file_in_plain_words(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\nfrom recorders import Recorder\n")
    assert _error_line(_cli("replay", script)) == (
        f"Error: {script}: not a torch file (it starts with text: 'import torch from recorders import Recor') "
        "(pass a file written by torch.save or the amp-autopsy recorder)")


def test_a_truncated_snapshot_says_truncated_and_debug_adds_torchs_own_message(failing_run, tmp_path):
    _, failing = failing_run
    cut = tmp_path / failing.name
    cut.write_bytes(failing.read_bytes()[:3000])
    line = _error_line(_cli("replay", cut))
    assert line == (f"Error: {cut}: truncated: the archive ends before its index (the file was cut short: copy it "
                    "again)")
    debug = CliRunner().invoke(main, ["--debug", "replay", str(cut)])
    assert debug.exit_code == 1
    assert "Traceback" in debug.output and "PytorchStreamReader" in debug.output  # torch's words, --debug only
    assert debug.output.strip().splitlines()[-1] == line


def test_an_empty_file_given_to_replay_says_empty(tmp_path):
    empty = tmp_path / "step00000001-r00000-nonfinite_loss.pt"
    empty.touch()
    assert _error_line(_cli("replay", empty)) == (
        f"Error: {empty}: empty file (0 bytes): not a torch file (pass a file written by torch.save or the "
        "amp-autopsy recorder)")


def test_a_safetensors_file_given_to_replay_names_inspect(tmp_path):
    import json
    import struct

    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    assert "analyzer inspect" in _error_line(_cli("replay", path))


def test_a_missing_option_value_is_still_clicks_usage_error(failing_run):
    result = _cli("replay", failing_run[1], "--dtypes")
    assert result.exit_code == 2 and "requires an argument" in result.output

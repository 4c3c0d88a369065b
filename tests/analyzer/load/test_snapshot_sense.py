"""Snapshot values that pass the type checks but no training run records, through the real
``analyzer replay`` CLI: one ``Error:`` line naming the file, the field and the value (exit 1, no
traceback), or a note the loaded Snapshot carries (``load_notes``) for values a replay can use."""
from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.cli import main
from analyzer.errors import BadInputError
from analyzer.load import load_snapshot
from recorders.snapshot import write_snapshot

from ...hostile_corpus import snapshot_dict

_FIX = "(the snapshot was edited or written by other code; replay a snapshot the Recorder wrote, or re-record the run)"


def _replay_error(tmp_path, **overrides) -> tuple[str, str]:
    path = write_snapshot(tmp_path / "snap.pt", snapshot_dict(**overrides))
    res = CliRunner().invoke(main, ["replay", str(path)])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.stderr
    return str(path), lines[0]


@pytest.mark.parametrize("device", ["banana", "gpu", "", "cuda:x"])
def test_a_device_type_that_is_no_torch_device_is_refused(tmp_path, device):
    path, line = _replay_error(tmp_path, device_type=device)
    assert line == f"Error: {path}: snapshot 'device_type' {device!r} is not a torch device type (cpu, cuda, mps, ...) {_FIX}"


@pytest.mark.parametrize("scale", [math.nan, -1.0])
def test_a_scale_no_gradscaler_has_is_refused(tmp_path, scale):
    path, line = _replay_error(tmp_path, scale=scale)
    assert line == f"Error: {path}: snapshot 'scale' {scale} is not a loss scale (GradScaler's is a number >= 0) {_FIX}"


def test_integer_weights_are_refused_naming_them(tmp_path):
    state = {"weight": torch.ones(2, 3, dtype=torch.int64), "bias": torch.zeros(2, dtype=torch.int32)}
    path, line = _replay_error(tmp_path, model_state=state)
    assert line == (f"Error: {path}: snapshot 'model_state' holds no floating-point tensor (weight: int64, bias: int32): "
                    f"integer weights were never trained in mixed precision {_FIX}")


def test_an_integer_weight_the_optimizer_trained_is_refused(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"weight": torch.ones(2, 3, dtype=torch.int16), "bias": torch.zeros(2)}
    optimizer = {"class": "torch.optim.sgd.SGD", "state_dict": opt.state_dict(), "param_names": ["weight", "bias"]}
    path, line = _replay_error(tmp_path, model_state=state, optimizer=optimizer)
    assert line == (f"Error: {path}: snapshot 'model_state' entry 'weight' is int16, but the optimizer trained it: a "
                    f"trained parameter is floating point {_FIX}")


@pytest.mark.parametrize("step", [math.nan, "3", 2**100])
def test_a_step_that_is_no_step_number_is_refused(tmp_path, step):
    path, line = _replay_error(tmp_path, step=step)
    assert line.startswith(f"Error: {path}: snapshot 'step' should be an integer >= ")


@pytest.mark.parametrize("scale", [2.0**100, math.inf])
def test_a_scale_no_fp16_backward_survives_is_a_note_before_the_replay(tmp_path, scale):
    snap = load_snapshot(write_snapshot(tmp_path / "s.pt", snapshot_dict(scale=scale)))
    (note,) = snap.load_notes
    assert note.startswith(f"the recorded loss scale {scale:.3g} is beyond any an FP16 backward survives")


def test_integer_weights_beside_float_ones_are_a_note(tmp_path):
    state = {"weight": torch.ones(2, 3, dtype=torch.uint8), "bias": torch.zeros(2)}
    snap = load_snapshot(write_snapshot(tmp_path / "s.pt", snapshot_dict(model_state=state)))
    assert snap.load_notes == ("model_state holds integer weights (weight: uint8): the rebuilt model loads them as "
                               "its own dtypes; a replay of a quantized layer is not the training step",)


def test_a_recorded_snapshot_has_no_notes(tmp_path):
    snap = load_snapshot(write_snapshot(tmp_path / "s.pt", snapshot_dict(scale=65536.0)))
    assert snap.load_notes == () and snap.scale == 65536.0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(device=st.text(max_size=20), scale=st.one_of(st.none(), st.floats(), st.integers(-2**70, 2**70)))
def test_any_device_type_and_scale_load_or_give_one_bad_input_error(tmp_path_factory, device, scale):
    path = write_snapshot(tmp_path_factory.mktemp("s") / "s.pt", snapshot_dict(device_type=device, scale=scale))
    try:
        snap = load_snapshot(path)
    except BadInputError as e:
        assert str(path) in str(e) and ("'device_type'" in str(e) or "'scale'" in str(e)), e
        return
    torch.device(snap.device_type)  # what loads is a device torch knows
    assert snap.scale is None or snap.scale >= 0

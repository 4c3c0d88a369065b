"""``analyzer replay`` on the command line: output, exit codes, and bad or hostile input files."""
from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main
from analyzer.errors import BadInputError, FactoryError, VersionError
from analyzer.replay import replay_snapshot
from recorders.snapshot import build_snapshot, write_snapshot

from . import replay_models as rm


def _snapshot(tmp_path, name="snap.pt", **overrides):
    """A real snapshot of the custom-op network (a failing FP16 step), with fields overridden."""
    model = rm.build_custom_op_net()
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(4, 4, generator=g) * 3, "y": torch.randn(4, 1, generator=g)}
    snap = build_snapshot(step=3, reason="nonfinite_loss", model=model, batch=batch,
                          rng={"cpu": torch.get_rng_state(), "cuda": None},
                          factory=f"{rm.REF}:build_custom_op_net", factory_kwargs={},
                          loss_fn=f"{rm.REF}:mse", amp_dtype=torch.float16, device_type="cpu")
    snap.update(overrides)
    return write_snapshot(tmp_path / name, snap)


def _invoke(*args):
    return CliRunner().invoke(main, ["replay", *map(str, args)])


def _one_line_error(result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


def test_replay_prints_the_verdict_culprit_and_advice_as_text(tmp_path):
    result = _invoke(_snapshot(tmp_path), "--ops", 4)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("verdict: unregistered_op\n")
    assert "ampautopsy_replaytests.square.default (custom op)" in result.output
    assert "ops around the culprit (float16):" in result.output and "what to try:" in result.output


def test_replay_json_is_one_strict_json_object_with_the_verdict(tmp_path):
    result = _invoke(_snapshot(tmp_path), "--json", "--dtypes", "fp32,fp16,bf16")
    assert result.exit_code == 0, result.output
    obj = json.loads(result.output, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert obj["verdict"] == "unregistered_op"
    assert obj["runs"]["float16"]["loss"] == "nan"  # non-finite floats are strings in JSON
    assert obj["runs"]["bfloat16"]["finite"] is True


def test_replay_plot_writes_a_nontrivial_png(tmp_path):
    png = tmp_path / "replay.png"
    result = _invoke(_snapshot(tmp_path), "--plot", png)
    assert result.exit_code == 0, result.output
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000  # a drawn figure, not an empty canvas


def test_factory_option_overrides_the_snapshots_factory(tmp_path):
    path = _snapshot(tmp_path, factory="not_a_module_anywhere:build")
    result = _invoke(path, "--json", "--factory", f"{rm.REF}:build_custom_op_net")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["verdict"] == "unregistered_op"


@pytest.mark.parametrize("content, expected", [
    (b"\x00\x01garbage" * 100, "not a torch file (it starts with bytes 00 01 67 61 72 62 61 67)"),
    (b"", "empty file (0 bytes): not a torch file"),
    (b"import torch\n\nmodel = torch.nn.Linear(4, 1)\n", "not a torch file (it starts with text: 'import torch model = "
                                                         "torch.nn.Linear(4, ')"),
])
def test_a_corrupt_file_is_a_one_line_error_naming_it(tmp_path, content, expected):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(content)
    line = _one_line_error(_invoke(bad))
    assert str(bad) in line and expected in line


def test_a_truncated_snapshot_is_a_one_line_error(tmp_path):
    path = _snapshot(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    line = _one_line_error(_invoke(path))
    assert line == f"Error: {path}: truncated: the archive ends before its index (the file was cut short: copy it again)"


def test_a_foreign_torch_file_is_refused_as_not_a_snapshot(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"weight": torch.ones(3)}, path)
    line = _one_line_error(_invoke(path))
    assert "not an amp-autopsy snapshot" in line and "analyzer inspect" in line


def test_a_snapshot_from_a_newer_format_asks_to_upgrade(tmp_path):
    path = _snapshot(tmp_path, format_version=99)
    with pytest.raises(VersionError, match="format version 99 is newer"):
        replay_snapshot(path)
    assert "upgrade amp-autopsy" in _one_line_error(_invoke(path))


def test_an_unimportable_factory_says_so_and_names_the_factory_option(tmp_path):
    path = _snapshot(tmp_path, factory="no_such_package.models:build")
    with pytest.raises(FactoryError):
        replay_snapshot(path)
    line = _one_line_error(_invoke(path))
    assert "cannot import factory 'no_such_package.models:build'" in line and "--factory" in line


@pytest.mark.parametrize("ref", ["os:system", "builtins:eval", "subprocess:call", "torch:load"])
def test_a_factory_reference_into_the_stdlib_builtins_or_torch_is_refused(tmp_path, ref):
    line = _one_line_error(_invoke(_snapshot(tmp_path, factory=ref)))
    assert f"refusing factory {ref!r}" in line


def test_a_loss_fn_reference_into_builtins_is_refused_naming_the_loss_fn_option(tmp_path):
    line = _one_line_error(_invoke(_snapshot(tmp_path, loss_fn="builtins:exec")))
    assert "refusing loss_fn 'builtins:exec'" in line and "--loss-fn" in line


class _Payload:
    """Pickles to a call of open(path, "w"): loading it with pickle would create the file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_loading_never_executes_code_from_the_file(tmp_path):
    marker = tmp_path / "pwned.txt"
    hostile = tmp_path / "hostile.pt"
    torch.save({"format": "amp-autopsy.snapshot", "payload": _Payload(marker)}, hostile)
    assert not marker.exists()
    with pytest.raises(BadInputError, match="refused"):
        replay_snapshot(hostile)
    line = _one_line_error(_invoke(hostile))
    assert "refused" in line and str(hostile) in line
    assert not marker.exists()  # weights_only loading never called open()


def test_weights_that_do_not_fit_the_factorys_model_name_the_factory_option(tmp_path):
    path = _snapshot(tmp_path, factory=f"{rm.REF}:build_mlp")
    line = _one_line_error(_invoke(path))
    assert "snapshot weights do not fit the model built by" in line and "--factory" in line


def test_a_loss_fn_that_returns_a_non_scalar_is_a_one_line_error(tmp_path):
    line = _one_line_error(_invoke(_snapshot(tmp_path, loss_fn=f"{rm.REF}:per_sample_loss")))
    assert "returned a tensor of shape (4, 1), expected a scalar" in line and "--loss-fn" in line


def test_a_loss_fn_that_raises_is_a_one_line_error_naming_the_exception(tmp_path):
    line = _one_line_error(_invoke(_snapshot(tmp_path, loss_fn=f"{rm.REF}:build_mlp")))  # wrong signature
    assert "loss_fn 'tests.analyzer.replay.replay_models:build_mlp' raised TypeError" in line


def test_a_snapshot_without_rng_state_is_a_bad_input(tmp_path):
    line = _one_line_error(_invoke(_snapshot(tmp_path, rng={"cpu": None})))
    assert "rng" in line and "re-record" in line


def test_a_snapshot_missing_keys_is_a_bad_input(tmp_path):
    path = tmp_path / "partial.pt"
    torch.save({"format": "amp-autopsy.snapshot", "format_version": 1, "step": 1}, path)
    assert "snapshot lacks keys" in _one_line_error(_invoke(path))


def test_an_unknown_dtype_is_a_one_line_error_naming_the_option(tmp_path):
    line = _one_line_error(_invoke(_snapshot(tmp_path), "--dtypes", "fp32,fp8"))
    assert "'fp8'" in line and "--dtypes" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_asking_for_cuda_without_cuda_is_a_one_line_error(tmp_path):
    assert "CUDA is not available" in _one_line_error(_invoke(_snapshot(tmp_path), "--device", "cuda"))


def test_a_missing_file_is_a_one_line_error(tmp_path):
    line = _one_line_error(_invoke(tmp_path / "nope.pt"))
    assert "no such file" in line


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cpu_snapshot_replays_on_cuda_and_says_the_devices_differ(tmp_path):
    r = replay_snapshot(_snapshot(tmp_path), device="cuda")
    assert r.device == "cuda" and "recorded on cpu, replayed on cuda" in r.device_note
    assert r.verdict == "unregistered_op"


def test_the_cli_replay_does_not_leave_files_behind(tmp_path):
    path = _snapshot(tmp_path)
    before = set(os.listdir(tmp_path))
    assert _invoke(path, "--json").exit_code == 0
    assert set(os.listdir(tmp_path)) == before


def test_a_backward_that_raises_is_a_one_line_error(tmp_path):
    model = rm.build_broken_backward()
    snap = build_snapshot(step=0, reason="manual", model=model,
                          batch={"x": torch.randn(4, 4), "y": torch.randn(4, 1)},
                          rng={"cpu": torch.get_rng_state(), "cuda": None},
                          factory=f"{rm.REF}:build_broken_backward", factory_kwargs={},
                          loss_fn=f"{rm.REF}:mse", amp_dtype=None, device_type="cpu")
    line = _one_line_error(_invoke(write_snapshot(tmp_path / "s.pt", snap)))
    assert "backward of the replayed step raised RuntimeError: this backward is not implemented" in line


def test_a_forward_that_runs_different_ops_on_each_replay_is_refused_not_misread(tmp_path):
    model = rm.build_classifier()
    batch = {"x": torch.tensor([[2.0, 0, 0, 0]]), "y": torch.tensor([2])}  # log(0): fails in FP32
    snap = build_snapshot(step=0, reason="nonfinite_loss", model=model, batch=batch,
                          rng={"cpu": torch.get_rng_state(), "cuda": None},
                          factory=f"{rm.REF}:build_classifier", factory_kwargs={},
                          loss_fn=f"{rm.REF}:first_call_differs_loss", amp_dtype=None, device_type="cpu")
    rm.CALLS["n"] = 0
    line = _one_line_error(_invoke(write_snapshot(tmp_path / "s.pt", snap)))
    assert "two replays of the same step in float32 ran different ops" in line and "deterministic" in line

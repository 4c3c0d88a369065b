"""Snapshot loading and factory resolution: version checks, bad files, and refusal to run code."""
from __future__ import annotations

import os
import pickle

import pytest
import torch

from analyzer.errors import BadInputError, FactoryError, VersionError
from analyzer.load import load_snapshot, resolve_ref, torch_load_safe
from recorders import schema
from recorders.snapshot import build_snapshot, write_snapshot


def build_linear(d: int = 4) -> torch.nn.Module:
    return torch.nn.Linear(d, d)


def linear_loss(model, batch):
    return model(batch["x"]).pow(2).mean()


def _snapshot(tmp_path, **overrides):
    model = build_linear()
    snap = build_snapshot(
        step=3, reason="manual", model=model, batch={"x": torch.randn(2, 4)},
        rng={"cpu": torch.get_rng_state(), "cuda": None},
        factory="tests.analyzer.load.test_snapshot:build_linear", factory_kwargs={"d": 4},
        loss_fn="tests.analyzer.load.test_snapshot:linear_loss", amp_dtype=torch.float16, device_type="cpu",
        scale=65536.0,
    )
    snap.update(overrides)
    path = tmp_path / "snap.pt"
    write_snapshot(path, snap)
    return path, model


def test_a_written_snapshot_loads_back_with_every_key_and_equal_tensors(tmp_path):
    path, model = _snapshot(tmp_path)
    snap = load_snapshot(path)
    assert tuple(snap) == schema.SNAPSHOT_KEYS
    assert snap["amp_dtype"] == "float16" and snap["scale"] == 65536.0
    for name, tensor in model.state_dict().items():
        assert torch.equal(snap["model_state"][name], tensor)
    rebuilt = resolve_ref(snap["factory"])(**snap["factory_kwargs"])
    rebuilt.load_state_dict(snap["model_state"])
    x = snap["batch"]["x"]
    assert torch.equal(rebuilt(x), model(x))


def test_a_loaded_snapshot_is_a_frozen_value_whose_attributes_are_the_files_keys(tmp_path):
    import dataclasses

    path, _ = _snapshot(tmp_path)
    snap = load_snapshot(path)
    raw = torch.load(path, weights_only=True)
    assert snap.path == str(path)
    for key in schema.SNAPSHOT_KEYS:  # every key, as an attribute, the value the file holds
        value = getattr(snap, key)
        assert value is snap[key] or value == raw[key] or (torch.is_tensor(raw[key]) and torch.equal(value, raw[key]))
    assert (snap.step, snap.reason, snap.amp_dtype, snap.scale) == (3, "manual", "float16", 65536.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.step = 4
    with pytest.raises(TypeError):
        snap["step"] = 4  # the mapping view is read-only too


def test_a_version_1_snapshot_without_cwd_loads_with_cwd_none(tmp_path):
    path, _ = _snapshot(tmp_path, format_version=1)
    raw = torch.load(path, weights_only=True)
    del raw["cwd"]
    torch.save(raw, path)
    snap = load_snapshot(path)
    assert snap.cwd is None and "cwd" not in snap and snap.format_version == 1


def test_a_snapshot_from_a_newer_format_is_refused_with_the_upgrade_fix(tmp_path):
    path, _ = _snapshot(tmp_path, format_version=schema.FORMAT_VERSION + 1)
    with pytest.raises(VersionError, match="newer") as e:
        load_snapshot(path)
    assert str(path) in str(e.value) and "pip install -U" in str(e.value)


@pytest.mark.parametrize("content, expect", [
    (b"", r"empty file \(0 bytes\): not a torch file"),
    (b"\x00garbage" * 10, r"not a torch file \(it starts with bytes 00 67 61 72 62 61 67 65\)"),
    (b"import torch\nmodel = build()\n", r"not a torch file \(it starts with text: 'import torch model = build\(\)'\)"),
])
def test_corrupt_files_give_one_line_errors_naming_the_file(tmp_path, content, expect):
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    with pytest.raises(BadInputError, match=expect) as e:
        load_snapshot(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_truncated_snapshot_is_reported_not_crashed_on(tmp_path):
    path, _ = _snapshot(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(BadInputError, match="truncated: the archive ends before its index") as e:
        load_snapshot(path)
    assert "Errno" not in str(e.value) and "miniz" not in str(e.value)  # torch's own words only under --debug


def test_a_foreign_torch_file_is_named_as_not_a_snapshot(tmp_path):
    path = tmp_path / "state.pt"
    torch.save(build_linear().state_dict(), path)
    with pytest.raises(BadInputError, match="not an amp-autopsy snapshot"):
        load_snapshot(path)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_loading_a_malicious_pickle_never_executes_its_code(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"format": schema.SNAPSHOT_FORMAT, "payload": _Evil(str(marker))}, path, pickle_module=pickle)
    with pytest.raises(BadInputError, match="refused"):
        torch_load_safe(path)
    assert not marker.exists()


@pytest.mark.parametrize("ref", ["os:system", "builtins:eval", "subprocess:run", "torch:load", "shutil:rmtree"])
def test_factory_references_into_the_stdlib_builtins_or_torch_are_refused(ref):
    with pytest.raises(FactoryError, match="refusing"):
        resolve_ref(ref)


@pytest.mark.parametrize("ref", ["no_such_pkg_xyz.models:build", "tests.analyzer.load.test_snapshot:nope", "nocolon"])
def test_unimportable_factories_name_the_factory_option(ref):
    with pytest.raises(FactoryError, match="--factory"):
        resolve_ref(ref)


def test_garbage_after_a_pickle_protocol_byte_is_reported_as_corrupt(tmp_path):
    # b"\x80\x02" opens a pickle stream; what follows makes the unpickler raise KeyError/IndexError.
    path = tmp_path / "garbage.pt"
    path.write_bytes(b"\x80\x02" + bytes(range(256)) * 4)
    with pytest.raises(BadInputError, match="a pickle stream .a legacy torch file. that is truncated or corrupt"):
        load_snapshot(path)


# -- bounded memory and validated values -------------------------------------------------------
def _deflated_snapshot(tmp_path, numel: int = 2_000_000):
    """A real snapshot (8 MB of zero batch data) re-zipped with deflate: ~10 KiB declaring 8 MB."""
    from tests.hostile_corpus import rezip

    path, _ = _snapshot(tmp_path, batch={"x": torch.zeros(numel)})
    import zipfile

    return rezip(path, tmp_path / "deflated.pt", {}, compression=zipfile.ZIP_DEFLATED)


def test_a_zip_bomb_is_refused_before_decompression_naming_the_flag(tmp_path):
    bomb = _deflated_snapshot(tmp_path)
    with pytest.raises(BadInputError, match=r"declares \d+ bytes uncompressed in a \d+-byte file.*"
                                            r"--max-archive-ratio N.*AMP_AUTOPSY_MAX_ARCHIVE_RATIO"):
        torch_load_safe(bomb)


def test_raising_the_archive_ratio_lets_a_trusted_compressed_file_load(tmp_path, monkeypatch):
    from analyzer.load import archive_ratio_limit

    bomb = _deflated_snapshot(tmp_path)
    monkeypatch.setenv("AMP_AUTOPSY_MAX_ARCHIVE_RATIO", "10000")
    assert load_snapshot(bomb)["batch"]["x"].numel() == 2_000_000
    monkeypatch.delenv("AMP_AUTOPSY_MAX_ARCHIVE_RATIO")
    with archive_ratio_limit(10000):  # what 'analyzer --max-archive-ratio 10000' does
        assert load_snapshot(bomb)["batch"]["x"].numel() == 2_000_000
    assert torch_load_safe(bomb, max_ratio=10000)["batch"]["x"].numel() == 2_000_000  # one read, given its ratio
    with pytest.raises(BadInputError, match="zip bomb"):
        load_snapshot(bomb)


def test_the_cli_flag_raises_the_archive_ratio(tmp_path):
    from click.testing import CliRunner

    from analyzer.cli import main

    bomb = _deflated_snapshot(tmp_path)
    refused = CliRunner().invoke(main, ["replay", str(bomb), "--show"])
    assert refused.exit_code == 1 and "zip bomb" in refused.stderr
    allowed = CliRunner().invoke(main, ["--max-archive-ratio", "10000", "replay", str(bomb), "--show"])
    assert "zip bomb" not in allowed.output


def test_a_plain_torch_save_file_is_well_inside_the_archive_ratio(tmp_path):
    path, _ = _snapshot(tmp_path, batch={"x": torch.randn(2_000_000)})  # stored, not compressed
    assert load_snapshot(path)["batch"]["x"].numel() == 2_000_000


def test_a_stride_0_view_in_a_snapshot_is_refused_without_materialising_it(tmp_path):
    path, _ = _snapshot(tmp_path, batch={"x": torch.zeros(1).expand(3_000_000_000)})
    assert path.stat().st_size < 16384  # 12 GB declared in a few KiB (rng state and model included)
    with pytest.raises(BadInputError, match=r"batch\['x'\] declares 3000000000 elements .* over 4 bytes"):
        load_snapshot(path)


def test_a_list_nested_100k_deep_is_refused_not_a_recursion_error(tmp_path):
    from tests.hostile_corpus import deep_pickle, rezip

    path, _ = _snapshot(tmp_path)
    deep = rezip(path, tmp_path / "deep.pt", {"data.pkl": deep_pickle(100_000)})
    with pytest.raises(BadInputError, match="nested more than 100 levels deep"):
        torch_load_safe(deep)


@pytest.mark.parametrize("overrides, match", [
    ({"format_version": -1}, "format_version -1 is negative"),
    ({"rng": {"cpu": torch.zeros(16, dtype=torch.uint8), "cuda": None}}, r"'rng' 'cpu' should be a uint8 tensor of 5056"),
    ({"model_state": {"w": [1.0]}}, r"'model_state' entry 'w' is a list, not a tensor"),
    ({"scaler_state": {"scale": float("inf")}}, r"'scaler_state' scale should be a positive finite number"),
    ({"step": 2.5}, r"'step' should be an integer"),
    ({"train_mode": 1}, r"'train_mode' should be True or False"),
])
def test_every_snapshot_value_is_checked_at_load(tmp_path, overrides, match):
    path, _ = _snapshot(tmp_path, **overrides)
    with pytest.raises(BadInputError, match=match):
        load_snapshot(path)

"""analyzer inspect on hostile and damaged files: one ``Error:`` line or a correct scan, never a traceback."""
from __future__ import annotations

import hashlib
import json
import struct
import zipfile

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.cli import main
from analyzer.errors import BadInputError
from analyzer.inspect import inspect_checkpoints

from ..inspect.inspect_values import STAT_FIELDS, expected


def _safetensors(header: dict, data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _one_error_line(path, *args) -> str:
    """Run the CLI on a bad file; assert exit 1, exactly one Error: line naming it, the file unchanged."""
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    res = CliRunner().invoke(main, ["inspect", str(path), *args])
    assert res.exit_code == 1, res.output
    (line,) = res.output.strip().splitlines()
    assert line.startswith("Error: ") and path.name in line and "Traceback" not in res.output
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    return line


_F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
_HOSTILE_HEADERS = {
    "boolean shape": ({"w": {**_F32x2, "shape": [True, True]}}, "bad shape"),
    "dimension 2**63": ({"w": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}}, "bad shape"),
    "boolean offsets": ({"w": {**_F32x2, "data_offsets": [False, 8]}}, "bad data_offsets"),
    "offsets past the end": ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, "truncated"),
    "overlapping tensors": ({"w": _F32x2, "v": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, "overlap"),
    "dtype a list": ({"w": {**_F32x2, "dtype": ["F32"]}}, "unknown dtype"),
    "entry not an object": ({"w": [1, 2]}, "not an object"),
}


@pytest.mark.parametrize("case", list(_HOSTILE_HEADERS))
def test_hostile_safetensors_headers_are_one_error_line(tmp_path, case):
    header, expect = _HOSTILE_HEADERS[case]
    path = tmp_path / "m.safetensors"
    path.write_bytes(_safetensors(header, b"\0" * 8))
    assert expect in _one_error_line(path)


def test_deeply_nested_or_huge_number_json_in_a_safetensors_header_is_one_error_line(tmp_path):
    path = tmp_path / "m.safetensors"
    text = b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    assert "nested too deeply" in _one_error_line(path)
    text = b'{"w": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 0]}}'
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    assert "not JSON" in _one_error_line(path)


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                     max_leaves=8)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["dtype", "shape", "data_offsets"]), value=_JSON, data_len=st.integers(0, 16))
def test_any_value_in_any_safetensors_field_is_read_or_refused_with_a_bad_input_error(tmp_path, field, value,
                                                                                      data_len):
    path = tmp_path / "m.safetensors"
    path.write_bytes(_safetensors({"w": {**_F32x2, field: value}}, b"\0" * data_len))
    try:
        result = inspect_checkpoints(path)
    except BadInputError as e:
        assert "\n" not in str(e) and "m.safetensors" in str(e)
    else:
        (t,) = result.files[0].tensors
        assert t.stats.numel == t.stats.zeros  # whatever was accepted is read as the zeros it holds


def test_a_rezipped_torch_file_with_unaligned_storages_is_scanned_exactly(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(1001, generator=g) * 1e4, "h": (torch.randn(333, generator=g) * 1e3).half(),
          "b": torch.randn(77, generator=g).bfloat16()}
    torch.save(sd, tmp_path / "a.pt")
    with zipfile.ZipFile(tmp_path / "a.pt") as src, zipfile.ZipFile(tmp_path / "b.pt", "w") as dst:
        first = src.infolist()[0].filename
        dst.writestr(first, src.read(first))
        dst.writestr(first.split("/")[0] + "/.odd", b"x")  # an odd-sized record shifts every storage after it
        for info in src.infolist()[1:]:  # and Python's zipfile drops torch's 64-byte alignment padding
            dst.writestr(info.filename, src.read(info.filename))
    loaded = torch.load(tmp_path / "b.pt", mmap=True, weights_only=True)
    assert any(t.data_ptr() % t.element_size() for t in loaded.values())  # the case this test is about
    stats = {t.name: t.stats for t in inspect_checkpoints(tmp_path / "b.pt").files[0].tensors}
    for name, t in sd.items():
        assert {k: getattr(stats[name], k) for k in STAT_FIELDS} == expected(t), name


def test_a_stride_0_tensor_of_huge_declared_size_is_scanned_through_its_storage(tmp_path):
    base = torch.tensor([1.0, float("nan"), 7e4])
    torch.save({"w": base.expand(2_000_000_000, 3)}, tmp_path / "c.pt")  # 6e9 elements declared, 12 bytes stored
    assert (tmp_path / "c.pt").stat().st_size < 4096
    res = CliRunner().invoke(main, ["inspect", str(tmp_path / "c.pt"), "--json"])
    assert res.exit_code == 0, res.output
    (t,) = json.loads(res.stdout)["files"][0]["tensors"]
    assert t["shape"] == [2_000_000_000, 3] and t["numel"] == 3 and (t["nan"], t["fp16_overflow"]) == (1, 1)


def test_checkpoint_containers_nested_past_the_limit_are_one_error_line(tmp_path):
    deep: list = [torch.ones(1)]
    for _ in range(150):
        deep = [deep]
    torch.save({"model": deep}, tmp_path / "deep.pt")
    assert "nested" in _one_error_line(tmp_path / "deep.pt")


def test_a_container_shared_many_times_over_is_walked_once(tmp_path):
    shared = [torch.ones(2)]
    for _ in range(16):  # 2**16 paths to one tensor through 16 shared lists (a pickle memo makes it cheap)
        shared = [shared, shared]
    torch.save({"x": shared}, tmp_path / "dag.pt")
    (t,) = inspect_checkpoints(tmp_path / "dag.pt").files[0].tensors  # one entry, not 65536
    assert t.stats.numel == 2


@pytest.mark.parametrize("groups, what", [
    ([{"params": [[0]], "lr": 1e-3}], "['params'] is not a list of integer ids"),
    ([{"params": [True], "lr": 1e-3}], "['params'] is not a list of integer ids"),
    ([{"params": 7}], "['params'] is not a list of integer ids"),
    ([{"params": [0], "param_names": [{"a": 1}]}], "['param_names'] is not a list of strings"),
])
def test_malformed_optimizer_param_groups_are_one_error_line(tmp_path, groups, what):
    opt = {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": groups}
    torch.save({"model": {"w": torch.ones(2)}, "optimizer": opt}, tmp_path / "c.pt")
    assert what in _one_error_line(tmp_path / "c.pt")


@pytest.mark.parametrize("scale", ["big", None, [1.0], torch.ones(3)])
def test_a_scaler_whose_scale_is_not_a_number_is_not_taken_for_a_scaler(tmp_path, scale):
    torch.save({"model": {"w": torch.ones(2)}, "scaler": {"scale": scale, "_growth_tracker": "x"}}, tmp_path / "c.pt")
    assert inspect_checkpoints(tmp_path / "c.pt").files[0].ckpt.scaler is None


def test_a_scaler_with_tensor_scale_and_tracker_reads_them_as_numbers(tmp_path):
    scaler = {"scale": torch.tensor(1024.0), "growth_factor": 2.0, "_growth_tracker": torch.tensor(5)}
    torch.save({"model": {"w": torch.ones(2)}, "scaler": scaler}, tmp_path / "c.pt")
    assert inspect_checkpoints(tmp_path / "c.pt").files[0].ckpt.scaler == {
        "path": "scaler", "scale": 1024.0, "growth_tracker": 5}

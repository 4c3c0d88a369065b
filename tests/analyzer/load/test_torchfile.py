"""torch files whose bytes changed after torch.save: torch.load reads them in silence, we do not.

torch's zip reader never checks the CRC-32 each record carries, so one flipped byte in a tensor
record loads as a different weight, and one in data.pkl as a different key. ``torch_load_safe``
checks the records against their CRCs first (``analyzer.load.torchfile.check_crcs``).
"""
from __future__ import annotations

import os
import warnings
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from analyzer.cli import main
from analyzer.errors import BadInputError
from analyzer.load import torchfile
from analyzer.load.torchfile import torch_load_safe
from recorders.snapshot import write_snapshot

from ...hostile_corpus import snapshot_dict


def _records(path: Path) -> dict[str, tuple[int, int]]:
    """Each record's data range in the file: name after the archive folder -> (start, end)."""
    out = {}
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as zf:
        for i in zf.infolist():
            n, m = int.from_bytes(raw[i.header_offset + 26:i.header_offset + 28], "little"), \
                int.from_bytes(raw[i.header_offset + 28:i.header_offset + 30], "little")
            start = i.header_offset + 30 + n + m
            out[i.filename.split("/", 1)[1]] = (start, start + i.compress_size)
    return out


def flipped(src: Path, dst: Path, at: int) -> Path:
    raw = bytearray(src.read_bytes())
    raw[at] ^= 0x01
    dst.write_bytes(bytes(raw))
    return dst


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    torch.manual_seed(0)
    torch.save({"weight": torch.randn(64, 32), "bias": torch.randn(64)}, tmp_path / "ckpt.pt")
    return tmp_path / "ckpt.pt"


def one_error(args: list[str]) -> str:
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    (line,) = res.stderr.strip().splitlines()
    return line


def test_torch_itself_loads_a_flipped_tensor_byte_in_silence(checkpoint, tmp_path):
    # the premise: without the CRC check the changed weight would be analysed as the real one
    start, end = _records(checkpoint)["data/0"]
    bad = flipped(checkpoint, tmp_path / "bad.pt", (start + end) // 2)
    assert not torch.equal(torch.load(bad, weights_only=True)["weight"], torch.load(checkpoint)["weight"])


@pytest.mark.parametrize("record", ["data/0", "data/1", "data.pkl"])
def test_inspect_refuses_a_flipped_byte_in_any_record_naming_it(checkpoint, tmp_path, record):
    start, end = _records(checkpoint)[record]
    bad = flipped(checkpoint, tmp_path / "bad.pt", (start + end) // 2)
    assert one_error(["inspect", str(bad)]) == (
        f"Error: {bad}: damaged: record 'ckpt/{record}' does not match the CRC-32 it was saved with (its bytes "
        "changed after torch.save wrote them; torch.load would read the changed values without a word) (copy "
        "the file again from its source, or save it again)")


def test_replay_refuses_a_snapshot_with_a_flipped_byte_in_its_weights(tmp_path):
    snap = write_snapshot(tmp_path / "snap.pt", snapshot_dict())
    rec = next(k for k in _records(snap) if k.startswith("data/"))
    start, end = _records(snap)[rec]
    bad = flipped(snap, tmp_path / "bad.pt", (start + end) // 2)
    line = one_error(["replay", str(bad)])
    assert line.startswith(f"Error: {bad}: damaged: record 'archive/{rec}' does not match the CRC-32")


def test_a_file_saved_without_crcs_still_loads(tmp_path):
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.arange(4.0)}, tmp_path / "nocrc.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    with zipfile.ZipFile(tmp_path / "nocrc.pt") as zf:
        assert {i.CRC for i in zf.infolist()} == {0}  # what torch writes: nothing to check against
    assert torch.equal(torch_load_safe(tmp_path / "nocrc.pt")["w"], torch.arange(4.0))


def test_a_sound_file_loads_without_a_warning(checkpoint):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(torch_load_safe(checkpoint)) == {"weight", "bias"}


def test_past_the_budget_large_records_go_unchecked_with_a_warning_and_small_ones_are_checked(
        tmp_path, monkeypatch):
    torch.save({"big": torch.randn(300_000), "small": torch.randn(8)}, tmp_path / "ckpt.pt")
    recs = _records(tmp_path / "ckpt.pt")
    monkeypatch.setattr(torchfile, "CRC_FULL_BYTES", 1 << 20)  # the 1.2 MB file is now "large"
    start, end = recs["data/0"]
    big = flipped(tmp_path / "ckpt.pt", tmp_path / "big.pt", (start + end) // 2)
    with pytest.warns(UserWarning, match=r"big.pt: 1 tensor record\(s\) over 1 MiB were not checked against their "
                                         r"CRC-32 \(the file holds more than 0 GiB"):
        torch_load_safe(big)
    start, end = recs["data.pkl"]
    pkl = flipped(tmp_path / "ckpt.pt", tmp_path / "pkl.pt", (start + end) // 2)
    with pytest.raises(BadInputError, match="record 'ckpt/data.pkl' does not match the CRC-32"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_load_safe(pkl)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frac=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
@example(frac=0.9892770657206668, bit=0)  # the zip64 locator's disk count: zipfile.is_zipfile raised
def test_any_flipped_bit_is_refused_when_it_lands_in_a_record_and_never_crashes(tmp_path_factory, frac, bit):
    d = tmp_path_factory.mktemp("flip")
    torch.manual_seed(0)
    torch.save({"weight": torch.randn(16, 8), "bias": torch.randn(16)}, d / "ok.pt")
    raw = bytearray((d / "ok.pt").read_bytes())
    at = int(frac * len(raw))
    raw[at] ^= 1 << bit
    (d / "ckpt.pt").write_bytes(bytes(raw))
    in_record = any(s <= at < e for s, e in _records(d / "ok.pt").values())
    res = CliRunner().invoke(main, ["inspect", str(d / "ckpt.pt")])
    assert "Traceback" not in res.output
    if in_record:
        assert res.exit_code == 1 and "damaged: record" in res.stderr, res.output
    elif res.exit_code:  # a header or the central directory: zip's or torch's own word, on one line
        assert res.exit_code == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr


def _zipfile_verdict(path: Path) -> str | None:
    """The first record zipfile itself finds damaged (it checks the CRC as it reads a record to its
    end), reading every record the way check_crcs reads a compressed one; None if none is."""
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
        return None
    with zf:
        for info in zf.infolist():
            if info.CRC == 0 or info.is_dir():
                continue
            try:
                torchfile._check_record(path, zf, info)
            except BadInputError as e:
                return str(e)
    return None


def _mapped_verdict(path: Path) -> str | None:
    try:
        torchfile.check_crcs(path)
    except BadInputError as e:
        return str(e)
    return None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)), min_size=1, max_size=3),
       header=st.booleans(), stdlib=st.booleans())
def test_the_in_place_check_gives_zipfiles_own_verdict_on_any_damage(tmp_path_factory, flips, header, stdlib):
    # check_crcs reads stored records in place; zipfile reads them through its own header checks.
    # Wherever the damage lands (record bytes, a local header's name or lengths, the central
    # directory), both must name the same record, or both none; with zlib-ng or stdlib zlib alike.
    d = tmp_path_factory.mktemp("crc")
    torch.manual_seed(1)
    torch.save({"weight": torch.randn(16, 8), "bias": torch.randn(16), "step": 3}, d / "ok.pt")
    raw = bytearray((d / "ok.pt").read_bytes())
    starts = sorted(s for s, _ in _records(d / "ok.pt").values())
    for frac, bit in flips:  # `header`: aim at the bytes just before a record (its local header)
        at = (max(0, starts[int(frac * len(starts))] - 1 - int(frac * 40)) if header
              else int(frac * len(raw)))
        raw[at] ^= 1 << bit
    (d / "bad.pt").write_bytes(bytes(raw))
    crc = torchfile._crc32
    try:
        if stdlib:
            torchfile._crc32 = zlib.crc32
        assert _mapped_verdict(d / "bad.pt") == _zipfile_verdict(d / "bad.pt")
    finally:
        torchfile._crc32 = crc


def test_the_crc_is_zlib_ngs_when_installed_with_stdlibs_values():
    pytest.importorskip("zlib_ng")
    data = bytes(range(256)) * 4099
    assert torchfile._crc32 is not zlib.crc32
    assert torchfile._crc32(memoryview(data)[7:]) & 0xFFFFFFFF == zlib.crc32(data[7:])


@pytest.mark.parametrize("damaged", ["a", "b"])
def test_inspect_of_a_pair_names_the_damaged_file_whichever_it_is(checkpoint, tmp_path, damaged):
    # each file's check runs beside the scan; the verdict is the same as when it ran first
    start, end = _records(checkpoint)["data/0"]
    bad = flipped(checkpoint, tmp_path / "bad.pt", (start + end) // 2)
    a, b = (bad, checkpoint) if damaged == "a" else (checkpoint, bad)
    assert one_error(["inspect", str(a), str(b)]).startswith(
        f"Error: {bad}: damaged: record 'ckpt/data/0' does not match the CRC-32")


def test_the_deferred_check_warns_in_the_callers_thread_and_raises_on_a_damaged_record(tmp_path, monkeypatch):
    torch.save({"big": torch.randn(300_000), "small": torch.randn(8)}, tmp_path / "ckpt.pt")
    recs = _records(tmp_path / "ckpt.pt")
    monkeypatch.setattr(torchfile, "CRC_FULL_BYTES", 1 << 20)
    obj, verify = torchfile.torch_load_deferred(tmp_path / "ckpt.pt", mmap=True)
    assert obj["small"].shape == (8,)
    with pytest.warns(UserWarning, match=r"1 tensor record\(s\) over 1 MiB were not checked"):
        verify()
    start, end = recs["data/1"]
    bad = flipped(tmp_path / "ckpt.pt", tmp_path / "bad.pt", (start + end) // 2)
    obj, verify = torchfile.torch_load_deferred(bad, mmap=True)  # loads: the damage is in a tensor's bytes
    with pytest.raises(BadInputError, match="record 'ckpt/data/1' does not match the CRC-32"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verify()


def test_a_load_that_fails_on_damage_reports_the_damaged_record_not_the_unpickling_error(checkpoint, tmp_path):
    start, end = _records(checkpoint)["data.pkl"]
    broke = 0
    for at in range(start, end, max(1, (end - start) // 16)):  # most flips break the pickle itself
        bad = flipped(checkpoint, tmp_path / "bad.pt", at)
        try:
            torch.load(bad, mmap=True, weights_only=True)
        except Exception:  # noqa: BLE001 - whatever torch raises on it
            broke += 1
        with pytest.raises(BadInputError, match="record 'ckpt/data.pkl' does not match the CRC-32"):
            torchfile.torch_load_deferred(bad, mmap=True)[1]()
    assert broke > 0


def _evict(path: Path) -> bool:
    """Drop `path`'s pages from the page cache; False where this file system keeps them (tmpfs)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return not torchfile._in_page_cache(path)


def test_a_file_in_the_page_cache_is_checked_beside_the_caller_and_one_on_disk_before(checkpoint, tmp_path):
    start, end = _records(checkpoint)["data/0"]
    bad = flipped(checkpoint, tmp_path / "bad.pt", (start + end) // 2)
    assert torchfile._in_page_cache(bad)  # just written
    obj, verify = torchfile.torch_load_deferred(bad, mmap=True)  # returns: the check runs beside
    with pytest.raises(BadInputError, match="record 'ckpt/data/0' does not match the CRC-32"):
        verify()
    del obj
    if not _evict(bad):
        pytest.skip("this file system keeps the file's pages in memory (tmpfs): nothing to read from disk")
    with pytest.raises(BadInputError, match="record 'ckpt/data/0' does not match the CRC-32"):
        torchfile.torch_load_deferred(bad, mmap=True)  # from disk: checked first, as torch_load_safe does
    assert torchfile._in_page_cache(bad)  # the check's read brought it in


def test_the_page_cache_probe_never_raises_on_files_it_cannot_map(tmp_path):
    (tmp_path / "empty.pt").write_bytes(b"")
    assert torchfile._in_page_cache(tmp_path / "empty.pt")  # nothing to read: as if cached
    proc = Path("/proc/self/status")
    if proc.exists():  # a file the kernel refuses to map
        assert torchfile._in_page_cache(proc)
    assert one_error(["inspect", str(tmp_path / "empty.pt")]).startswith(f"Error: {tmp_path / 'empty.pt'}")


@pytest.mark.parametrize("command", ["inspect", "replay"])
def test_a_damaged_zip64_locator_is_one_error_line_for_every_reader(tmp_path, command):
    # the locator's "total number of disks" (its last 4 bytes) read as 2: zipfile.is_zipfile raises
    # BadZipFile ("span multiple disks") instead of answering, in the message's and in replay's paths
    torch.manual_seed(0)
    torch.save({"weight": torch.randn(16, 8), "bias": torch.randn(16)}, tmp_path / "ok.pt")
    raw = bytearray((tmp_path / "ok.pt").read_bytes())
    locator = raw.rfind(b"PK\x06\x07")
    assert locator > 0, "torch.save wrote no zip64 locator"
    raw[locator + 16] ^= 3
    (tmp_path / "ckpt.pt").write_bytes(bytes(raw))
    with pytest.raises(zipfile.BadZipFile, match="multiple disks"):
        zipfile.is_zipfile(tmp_path / "ckpt.pt")
    res = CliRunner().invoke(main, [command, str(tmp_path / "ckpt.pt")])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert res.stderr.strip().splitlines() == [
        f"Error: {tmp_path / 'ckpt.pt'}: not a readable torch file: its zip index is damaged (zipfiles that span "
        "multiple disks are not supported) (copy the file again from its source)"]

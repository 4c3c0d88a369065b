"""A cold checkpoint read once, front to back, with the scan following the read (``load._stream``).

``torch_load_streamed`` loads the object with each record's offset computed from torch.save's
layout, checks every record's CRC-32 on the bytes as the reader passes them, and checks the
layout against a second load that reads every record's header: a file laid out otherwise is
loaded again the usual way (``LayoutMismatch``), never scanned from the wrong bytes.
"""
from __future__ import annotations

import threading
import time
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.errors import BadInputError
from analyzer.inspect import _diagnose, inspect_checkpoints
from analyzer.load import _stream, torchfile
from analyzer.load.checkpoints import load_checkpoint

from .test_torchfile import _evict, _records, flipped


def _save(path: Path, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    w = {f"layers.{i}.weight": torch.randn(64, 48, generator=g).to(dt) for i, dt in
         enumerate([torch.float32, torch.bfloat16, torch.float16])}
    w["layers.0.weight"][0, :3] = torch.tensor([float("nan"), 1e-8, 7e4])
    state = {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(64, 48, generator=g) * 1e-4,
                 "exp_avg_sq": torch.rand(64, 48, generator=g) * 1e-12} for i in range(3)}
    opt = {"state": state, "param_groups": [{"params": [0, 1, 2], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}]}
    torch.save({"model": w, "optimizer": opt, "step": 10}, path)
    return path


def _rezipped(src: Path, dst: Path, order=None) -> Path:
    """The same records through Python's zipfile: no 64-byte alignment padding (torch.load reads it
    fine; torch.save's layout no longer holds), optionally in another order."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        names = zin.namelist()
        for n in (order(names) if order else names):
            zout.writestr(n, zin.read(n))
    return dst


def _summary(result) -> list:
    return ([(f.label, [(t.name, t.role, t.stats) for t in f.tensors]) for f in result.files],
            [(f.check, f.message) for f in result.findings], result.changes)


@pytest.fixture
def small_streams(monkeypatch):
    """Stream files of any size, in blocks of 4 KiB (many boundaries inside records and headers)."""
    monkeypatch.setattr(_stream, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(_stream, "BLOCK", 4096)


def _cold(path: Path) -> Path:
    if not _evict(path):
        pytest.skip("this file system keeps the file's pages in memory (tmpfs): nothing to read from disk")
    return path


def test_a_streamed_inspect_of_a_cold_file_matches_the_inspect_of_a_cached_one(tmp_path, small_streams):
    path = _save(tmp_path / "ckpt.pt")
    cached = inspect_checkpoints(path)
    streamed = _stream.torch_load_streamed(_cold(path))
    assert streamed is not None  # cold, a zip: streamed
    streamed[1]()  # the read ends, the CRCs and the layout agree
    assert inspect_checkpoints(_cold(path)).files[0].tensors
    assert _summary(inspect_checkpoints(_cold(path))) == _summary(cached)


def test_each_tensor_waits_for_the_end_of_its_own_record(tmp_path, small_streams):
    path = _save(tmp_path / "ckpt.pt")
    ends = {end for name, (_, end) in _records(path).items() if name.startswith("data/")}
    ckpt = load_checkpoint(_cold(path), defer_crc=True, stream=True)
    assert ckpt.stream is not None
    for e in ckpt.entries:
        assert _stream.storage_end(ckpt.stream, e.tensor) in ends, e.name
        ckpt.wait(e.tensor)
        assert ckpt.stream._read >= _stream.storage_end(ckpt.stream, e.tensor)
    ckpt.verify()


def test_a_streamed_pair_matches_the_cached_pair(tmp_path, small_streams):
    a, b = _save(tmp_path / "a.pt"), _save(tmp_path / "b.pt", seed=1)
    cached = inspect_checkpoints(a, b)
    _cold(a), _cold(b)
    assert _summary(inspect_checkpoints(a, b)) == _summary(cached)


def test_files_in_the_page_cache_small_or_not_zip_are_not_streamed(tmp_path, monkeypatch):
    path = _save(tmp_path / "ckpt.pt")
    monkeypatch.setattr(_stream, "STREAM_MIN_BYTES", 0)
    assert _stream.torch_load_streamed(path) is None  # just written: in the page cache
    monkeypatch.setattr(_stream, "STREAM_MIN_BYTES", path.stat().st_size + 1)
    assert _stream.torch_load_streamed(_cold(path)) is None  # under the size worth streaming
    (tmp_path / "x.pt").write_bytes(b"not a zip" * 100)
    monkeypatch.setattr(_stream, "STREAM_MIN_BYTES", 0)
    assert _stream.torch_load_streamed(_cold(tmp_path / "x.pt")) is None


def test_a_damaged_tensor_record_is_named_when_streamed(tmp_path, small_streams):
    path = _save(tmp_path / "ckpt.pt")
    start, end = _records(path)["data/2"]
    bad = _cold(flipped(path, tmp_path / "bad.pt", (start + end) // 2))
    with pytest.raises(BadInputError, match="record 'ckpt/data/2' does not match the CRC-32"):
        inspect_checkpoints(bad)


@pytest.mark.parametrize("order", [None, lambda names: [names[0], *reversed(names[1:])]],
                         ids=["unpadded", "unpadded-and-reordered"])
def test_a_file_not_in_torch_saves_layout_is_inspected_from_the_right_bytes(tmp_path, small_streams, order):
    path = _save(tmp_path / "ckpt.pt")
    other = _rezipped(path, tmp_path / "other.pt", order)
    want = _summary(inspect_checkpoints(path))
    got = _summary(inspect_checkpoints(_cold(other)))
    assert got[0][0][1] == want[0][0][1] and got[1] == want[1]


def test_a_load_from_the_wrong_bytes_is_caught_by_the_second_load(tmp_path, small_streams):
    # unpadded records: torch.save's layout puts the last tensor at the wrong offset, and torch.load
    # with calculate_storage_offsets reads it from there in silence
    other = _rezipped(_save(tmp_path / "ckpt.pt"), tmp_path / "other.pt")
    obj, verify, _ = _stream.torch_load_streamed(_cold(other))
    assert not torch.equal(obj["optimizer"]["state"][2]["exp_avg_sq"],
                           torch.load(other, weights_only=True)["optimizer"]["state"][2]["exp_avg_sq"])
    with pytest.raises(_stream.LayoutMismatch):
        verify()


def test_unstreamed_inspect_is_what_a_layout_mismatch_falls_back_to(tmp_path, small_streams):
    path = _save(tmp_path / "ckpt.pt")
    assert _summary(_diagnose._inspect(path, None, False, "cpu", stream=False)) == _summary(inspect_checkpoints(path))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(at=st.floats(0, 1, exclude_max=True), block=st.sampled_from([512, 4096, 5000, 1 << 20]))
def test_the_stream_finds_the_damaged_record_the_whole_file_check_finds(tmp_path, monkeypatch, at, block):
    monkeypatch.setattr(_stream, "BLOCK", block)
    path = tmp_path / "ckpt.pt"
    if not path.exists():
        _save(path)
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:  # the directory as it was: a flip there is the loader's to meet
        infos = zf.infolist()
        directory = zf.start_dir  # so the flip lands in the records, never in the central directory
    raw[int(at * directory)] ^= 0x10
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(raw))
    damaged, later = _stream.Stream(bad, infos, torchfile._crc32).result()
    got = torchfile._damaged(bad, damaged) if damaged else None
    if got is None and later:
        got = torchfile._crc_verdict(bad, names={i.filename for i in later})[0]
    want = torchfile._crc_verdict(bad)[0]
    assert (str(got) if got else None) == (str(want) if want else None)


def test_the_stream_waits_until_the_bytes_are_read_and_never_hangs_after_the_end(tmp_path, small_streams):
    path = _save(tmp_path / "ckpt.pt")
    with zipfile.ZipFile(path) as zf:
        s = _stream.Stream(path, zf.infolist(), torchfile._crc32)
    s.wait(path.stat().st_size)
    assert s._read == path.stat().st_size
    s.wait(10 * path.stat().st_size)  # past the end: returns once the read has stopped
    assert s.result() == (None, [])


def test_two_streams_take_turns_a_block_each_on_one_reader_thread(tmp_path, small_streams):
    paths = [_save(tmp_path / "a.pt"), _save(tmp_path / "b.pt", seed=1)]
    log = []

    def slow_crc(data, value):  # the first file's reads are slowed, so the second joins while it reads
        time.sleep(0.002)
        return torchfile._crc32(data, value)

    class Logged(type(threading.Condition())):
        def __init__(self, name, stream):
            super().__init__()
            self.name, self.stream = name, stream

        def notify_all(self):  # called once per block read, with the new progress
            log.append((self.name, self.stream._read, threading.get_ident()))
            super().notify_all()

    infos = [zipfile.ZipFile(p).infolist() for p in paths]
    s_a = _stream.Stream(paths[0], infos[0], slow_crc)
    s_a._cond = Logged("a", s_a)
    s_b = _stream.Stream(paths[1], infos[1], torchfile._crc32, beside=s_a)
    s_b._cond = Logged("b", s_b)
    assert s_a.result() == (None, []) and s_b.result() == (None, [])
    assert len({thread for *_, thread in log}) == 1  # one reader for both files
    names = [name for name, *_ in log]
    first_b = names.index("b")
    a_left = [at for name, at, _ in log if name == "a"][-1] - log[first_b - 1][1]
    assert log[first_b - 1][0] == "a" and a_left > 4 * _stream.BLOCK  # b joined while a was still reading
    both = min(names[first_b:].count("a"), names[first_b:].count("b"))
    assert names[first_b:first_b + 2 * both] == ["b", "a"] * both  # in turns, a block each

"""A torch zip file not in the page cache, read once front to back, with its reader's progress.

From disk, the fastest way to bring a file in is one reader going front to back: a second reader
at once, or reads in another order, come slower, and even a few scattered reads ahead of the
reader (torch.load reading every record's local header) break the kernel's read-ahead. So
``torch_load_streamed`` loads the object without reading those headers and starts a ``Stream``:
one thread reading the file in order through a read-only map marked sequential, which checks
each stored record's CRC-32 on the pages as they come in (no second read) and says how far it
has got every ``BLOCK`` bytes. ``wait(end)`` returns once the records up to byte `end` are in the
page cache, where the object's own mapping finds them. Two files inspected together are read by
the same thread in turns, a block each, so that a pair of tensors comes in together.
"""
from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInputError
from ._limits import check_nesting, max_archive_ratio
from .torchfile import (ZIP_ERRORS, _act_on, _check_archive, _crc32, _crc_verdict, _damaged, _in_page_cache,
                        _torch_load, is_zip, record_start)

__all__ = ["torch_load_streamed", "storage_end", "Stream", "LayoutMismatch", "BLOCK", "STREAM_MIN_BYTES"]

BLOCK = 8 << 20  # bytes read between two reports of progress
STREAM_MIN_BYTES = 64 << 20  # smaller files gain little from following the read: loaded as before


class Stream:
    """Read `path` front to back, checking the CRC-32 of every stored record of `infos` on the way: in
    a daemon thread of its own, or, `beside` another Stream still reading, in that one's thread, the
    two taking turns a block each (one reader per disk at a time, and a pair's tensors come in together).

    ``wait(end)`` blocks until the records in the first `end` bytes are read (or the read stopped);
    ``result()`` waits for the end and gives (the first record whose bytes do not match their
    CRC-32, or None; the records it could not check in passing, for the caller to check).
    """

    def __init__(self, path: Path, infos: list[zipfile.ZipInfo], crc32, beside: Stream | None = None):
        self.path = path
        self.base: int | None = None  # the address of the file's byte 0 in the loaded object's mapping
        self._infos = sorted((i for i in infos if i.CRC != 0 and not i.is_dir()), key=lambda i: i.header_offset)
        self._crc32 = crc32
        self._read = 0
        self._finished = False
        self._cond = threading.Condition()
        self._outcome: tuple | BaseException | None = None
        self._turns = beside._turns if beside is not None else None
        if self._turns is None or not self._turns.join(self):
            self._turns = _Turns(self)

    def wait(self, end: int) -> None:
        if self._read >= end or self._finished:  # NB: read without the lock: both only grow
            return
        with self._cond:
            while self._read < end and not self._finished:
                self._cond.wait()

    def result(self) -> tuple[zipfile.ZipInfo | None, list[zipfile.ZipInfo]]:
        self.wait(math.inf)  # returns once the read has stopped
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

    def _blocks(self) -> Iterator[None]:
        """Read and check one block per step; the outcome is set when the file is done."""
        try:
            self._outcome = yield from self._stream()
        except BaseException as e:  # noqa: BLE001 - handed to the caller by result()
            self._outcome = e
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _stream(self) -> Iterator[None]:
        # NB: read through a read-only map of the file marked sequential (the kernel reads ahead of
        # the faults), not readinto: no copy into a buffer, so the CRC reads each page where it lies,
        # and the scan following the read competes for less memory bandwidth (measured: 1.02-1.07x
        # a read() where readinto took 1.14-1.17x)
        with open(self.path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            if hasattr(mmap, "MADV_SEQUENTIAL"):
                m.madvise(mmap.MADV_SEQUENTIAL)
            data = memoryview(m)
            try:
                return (yield from self._check(data))
            finally:
                data.release()
        finally:
            with contextlib.suppress(BufferError):  # a slice held by a traceback: closed when collected
                m.close()

    def _check(self, data: memoryview) -> Iterator[None]:
        damaged, later = None, []
        todo = iter(self._infos)
        nxt = next(todo, None)
        cur = None  # [info, data start, data end, crc so far] of the record being read
        size = len(data)
        for pos in range(0, size, BLOCK):
            hi = min(size, pos + BLOCK)
            while True:
                if cur is None:
                    if nxt is None or nxt.header_offset >= hi:
                        break
                    start = record_start(nxt, size, lambda at, k: data[at:at + k])  # NB: this block or the next
                    if start is None or start < pos:  # odd, compressed, or overlapping: checked after
                        later.append(nxt)
                    else:
                        cur = [nxt, start, start + nxt.file_size, 0]
                    nxt = next(todo, None)
                    continue
                info, s, e, crc = cur
                a, b = max(s, pos), min(e, hi)
                if a < b:
                    cur[3] = crc = self._crc32(data[a:b], crc)
                if e > hi:
                    break
                if crc & 0xFFFFFFFF != info.CRC and damaged is None:
                    damaged = info
                cur = None
            with self._cond:
                self._read = hi
                self._cond.notify_all()
            yield
        if cur is not None:  # the file ended inside it (it changed since its directory was read)
            later.append(cur[0])
        later += [nxt, *todo] if nxt is not None else []
        return damaged, later


class _Turns:
    """One reader thread for the streams of one inspect: each in turn reads a block, until all are done."""

    def __init__(self, first: Stream):
        self._lock = threading.Lock()
        self._streams = [first._blocks()]
        self._open = True
        threading.Thread(target=self._run, name="amp-autopsy-read", daemon=True).start()

    def join(self, stream: Stream) -> bool:
        """Take `stream` into the turns; False when the thread has ended (start another)."""
        with self._lock:
            if self._open:
                self._streams.append(stream._blocks())
            return self._open

    def _run(self) -> None:
        i = 0
        while True:
            with self._lock:
                if not self._streams:
                    self._open = False
                    return
                i %= len(self._streams)
                blocks = self._streams[i]
            if next(blocks, StopIteration) is StopIteration:  # NB: _blocks catches every error itself
                with self._lock:
                    self._streams.remove(blocks)
            else:
                i += 1


class LayoutMismatch(Exception):
    """``torch_load_streamed``'s object did not map the bytes torch.load maps: load it again unstreamed."""


def torch_load_streamed(path: str | os.PathLike,
                        beside: Stream | None = None) -> tuple[Any, Callable[[], None], Stream] | None:
    """``torchfile.torch_load_deferred(path, mmap=True)`` for a zip-format file of at least ``STREAM_MIN_BYTES``
    that is not in the page cache: (the object, ``verify``, the ``Stream`` reading the file), or None
    for any other file (load that one with ``torch_load_deferred``).

    One thread reads the file front to back at the disk's speed and checks every stored record's
    CRC-32 as it passes; call ``stream.wait(end)`` before reading a tensor whose storage ends at byte
    `end` of the file (``storage_end``), so the reads follow it instead of racing it. The object is
    loaded with each record's offset computed from torch.save's layout
    (``calculate_storage_offsets``), since reading every record's local header first would scatter
    reads ahead of the reader. ``verify()`` waits for the read, raises for a damaged record as
    ``torchfile.check_crcs`` does, then loads the file again the usual way (from the page cache now) and
    raises ``LayoutMismatch`` if any tensor maps other bytes: then everything read from the object
    must be thrown away and the file loaded with ``torch_load_deferred``. `beside`: another file's
    Stream to take turns with, a block each (two files on one disk, read together).
    """
    path = Path(path)
    try:
        st = path.stat()
        if not path.is_file() or st.st_size < STREAM_MIN_BYTES or not is_zip(path) or _in_page_cache(path):
            return None
        _check_archive(path, max_archive_ratio())
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except (*ZIP_ERRORS, BadInputError):
        return None  # torch_load_deferred says what is wrong with it
    stream = Stream(path, infos, _crc32, beside)

    def outcome() -> tuple[BadInputError | None, int]:
        try:
            damaged, later = stream.result()
        except OSError:  # the read failed part way: the whole-file check says what it can
            return _crc_verdict(path)
        if damaged is not None:
            return _damaged(path, damaged), 0
        return _crc_verdict(path, names={i.filename for i in later}) if later else (None, 0)

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with _offsets_from_layout():
                    obj = _torch_load(path, True)
            except BadInputError:  # not torch.save's layout (its records moved): each from its header
                obj = _torch_load(path, True)
        check_nesting(obj, path=path, what="the file's content")
    except BaseException:
        _act_on(path, *outcome(), stacklevel=3)  # a damaged record is the cause: its error first
        raise
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    stream.base = _base(path, infos, obj)

    def verify() -> None:
        _act_on(path, *outcome(), stacklevel=3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # already shown for the first load
            again = _torch_load(path, True)
        if not _same_bytes(obj, again):
            raise LayoutMismatch(str(path))

    return obj, verify, stream


def storage_end(stream: Any, t: torch.Tensor) -> int:
    """The file offset where the bytes of `t`'s storage end, in ``torch_load_streamed``'s object
    (a tensor not mapped from that file gives 0 or a number past its end: waiting on it is safe)."""
    s = t.untyped_storage()
    return s.data_ptr() - stream.base + s.nbytes() if stream.base is not None else 0


@contextlib.contextmanager
def _offsets_from_layout():
    config = getattr(getattr(torch.utils, "serialization", None), "config", None)
    if config is None or not hasattr(getattr(config, "load", None), "calculate_storage_offsets"):
        yield  # an older torch: every record's header is read (slower, the same object)
        return
    with config.patch("load.calculate_storage_offsets", True):
        yield


def _tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor of a loaded object tree, depth first in its own order (bounded by check_nesting)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)
    return out


def _base(path: Path, infos: list[zipfile.ZipInfo], obj: Any) -> int | None:
    """The address of the file's byte 0 in the object's mapping: the first storage torch.load lays
    out is record data/0, whose offset it (and so this) reads from its local header."""
    ptrs = [t.untyped_storage().data_ptr() for t in _tensors(obj, []) if t.device.type == "cpu"]
    first = next((i for i in infos if i.filename.endswith("/data/0") or i.filename == "data/0"), None)
    if not ptrs or first is None:
        return None
    with open(path, "rb") as f:
        start = record_start(first, os.fstat(f.fileno()).st_size, lambda at, n: os.pread(f.fileno(), n, at))
    return None if start is None else min(ptrs) - start


def _same_bytes(a: Any, b: Any) -> bool:
    """Whether two loads of one file map every tensor to the same bytes of it: the same tensors in
    the same order, each at one fixed distance between the two mappings (data/0, the first record,
    is found from its header in both loads, so one fixed distance means every offset agrees)."""
    ta, tb = _tensors(a, []), _tensors(b, [])
    if len(ta) != len(tb):
        return False
    shift = None
    for x, y in zip(ta, tb):
        if (x.dtype, x.shape, x.stride(), x.storage_offset()) != (y.dtype, y.shape, y.stride(), y.storage_offset()):
            return False
        sx, sy = x.untyped_storage(), y.untyped_storage()
        if sx.nbytes() != sy.nbytes():
            return False
        d = sy.data_ptr() - sx.data_ptr()
        if shift is None:
            shift = d
        elif d != shift:
            return False
    return True

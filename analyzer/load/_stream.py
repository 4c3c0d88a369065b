"""One sequential read of a torch zip file that is not in the page cache, for a scan to follow.

From disk, the fastest way to bring a file in is one reader going front to back: pages faulted in
through a mapping, or a second reader, come slower, and even a few scattered reads ahead of the
reader (torch.load reading every record's local header) break the kernel's read-ahead. So
``Stream`` reads the file in one thread, in ``BLOCK``-byte ``readinto`` calls, checks each stored
record's CRC-32 on the bytes as they pass (no second read), and says how far it has got:
``wait(end)`` returns once byte `end` is in the page cache, where a mapping of the file then
finds it. ``torchfile.torch_load_streamed`` is its user.
"""
from __future__ import annotations

import os
import struct
import threading
import zipfile
from pathlib import Path

__all__ = ["Stream", "BLOCK", "record_start"]

BLOCK = 8 << 20  # bytes per read
LOCAL_HEADER = struct.Struct("<4s2xH18xHH")  # a zip local file header: signature, flags, name and extra lengths
_UNREADABLE = 0x1 | 0x20 | 0x40  # encrypted, patched, strongly encrypted: zipfile refuses to read these


def record_start(info: zipfile.ZipInfo, size: int, read) -> int | None:
    """Where a stored record's bytes start in a file of `size` bytes, from its local header
    (``read(offset, n) -> bytes``), checked as ``zipfile.ZipFile.open`` checks it before reading;
    None for a compressed record or one whose header or extent does not fit (zipfile then reads it,
    and reports it, so both ways give the same verdict)."""
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size \
            or info.flag_bits & _UNREADABLE or info.header_offset < 0:
        return None
    head = read(info.header_offset, LOCAL_HEADER.size)
    if len(head) < LOCAL_HEADER.size:
        return None
    magic, flags, name_len, extra_len = LOCAL_HEADER.unpack(head)
    name_at = info.header_offset + LOCAL_HEADER.size
    begin = name_at + name_len + extra_len
    if magic != zipfile.stringFileHeader or begin + info.file_size > size:
        return None
    name = bytes(read(name_at, name_len)).decode("utf-8" if flags & 0x800 else "cp437", "replace")
    return begin if name == info.orig_filename else None


class Stream:
    """Read `path` front to back in a daemon thread (after `after` has finished, if given: one
    reader per disk at a time), checking the CRC-32 of every stored record of `infos` on the way.

    ``wait(end)`` blocks until the first `end` bytes are read (or the read stopped);
    ``result()`` waits for the end and gives (the first record whose bytes do not match their
    CRC-32, or None; the records it could not check in passing, for the caller to check).
    """

    def __init__(self, path: Path, infos: list[zipfile.ZipInfo], crc32, after: Stream | None = None):
        self.path = path
        self.base: int | None = None  # the address of the file's byte 0 in the loaded object's mapping
        self._infos = sorted((i for i in infos if i.CRC != 0 and not i.is_dir()), key=lambda i: i.header_offset)
        self._crc32 = crc32
        self._read = 0
        self._finished = False
        self._cond = threading.Condition()
        self._outcome: tuple | BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(after,), name="amp-autopsy-read", daemon=True)
        self._thread.start()

    def wait(self, end: int) -> None:
        if self._read >= end or self._finished:  # NB: read without the lock: both only grow
            return
        with self._cond:
            while self._read < end and not self._finished:
                self._cond.wait()

    def join(self) -> None:
        self._thread.join()

    def result(self) -> tuple[zipfile.ZipInfo | None, list[zipfile.ZipInfo]]:
        self._thread.join()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

    def _run(self, after: Stream | None) -> None:
        try:
            if after is not None:
                after.join()
            self._outcome = self._stream()
        except BaseException as e:  # noqa: BLE001 - handed to the caller by result()
            self._outcome = e
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _stream(self) -> tuple[zipfile.ZipInfo | None, list[zipfile.ZipInfo]]:
        damaged, later = None, []
        todo = iter(self._infos)
        nxt = next(todo, None)
        cur = None  # [info, data start, data end, crc so far] of the record being read
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        pos = 0
        with open(self.path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            while True:
                n = f.readinto(view)
                if not n:
                    break
                hi = pos + n
                while True:
                    if cur is None:
                        if nxt is None or nxt.header_offset >= hi:
                            break
                        start = record_start(nxt, size, lambda at, n: os.pread(f.fileno(), n, at))  # this block or the next
                        if start is None or start < pos:  # odd, compressed, or overlapping: checked after
                            later.append(nxt)
                        else:
                            cur = [nxt, start, start + nxt.file_size, 0]
                        nxt = next(todo, None)
                        continue
                    info, s, e, crc = cur
                    a, b = max(s, pos), min(e, hi)
                    if a < b:
                        cur[3] = crc = self._crc32(view[a - pos:b - pos], crc)
                    if e > hi:
                        break
                    if crc & 0xFFFFFFFF != info.CRC and damaged is None:
                        damaged = info
                    cur = None
                pos = hi
                with self._cond:
                    self._read = pos
                    self._cond.notify_all()
        if cur is not None:  # the file ended inside it (it changed since its directory was read)
            later.append(cur[0])
        later += [nxt, *todo] if nxt is not None else []
        return damaged, later

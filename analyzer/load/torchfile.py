"""Read a torch file safely: weights_only, a zip-bomb bound and a nesting bound, one-line errors.

Every reader of a ``.pt`` file (snapshots, checkpoints) goes through ``torch_load_safe``.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import mmap
import os
import pickle
import re
import struct
import threading
import warnings
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import BadInputError
from ._limits import ARCHIVE_RATIO_ENV, archive_budget, check_nesting, max_archive_ratio

__all__ = ["torch_load_safe", "torch_load_deferred", "check_crcs", "is_zip", "record_start", "ZIP_ERRORS"]

# what zipfile raises on a damaged or foreign archive (ValueError: bad names), opening it or its index
ZIP_ERRORS = (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError)


def torch_load_safe(path: str | os.PathLike, *, mmap: bool = False, max_ratio: float | None = None) -> Any:
    """``torch.load(weights_only=True)`` with every failure mapped to a one-line BadInputError.

    Loading never executes code from the file: weights_only refuses pickled classes. Memory is
    bounded before anything is allocated: a zip archive may not declare more uncompressed bytes
    than ``_limits.archive_budget`` allows for its size (torch itself checks each storage record
    against the size the pickle declares), and nesting deeper than ``_limits.MAX_NESTING`` is
    refused. Every record is checked against its CRC-32 first (``check_crcs``). Warnings torch
    emits while reading are held back: dropped when the file is refused, re-issued after a
    successful load.

    `max_ratio` bounds this read's archive (declared bytes per byte of file); None: the ratio in
    force (``archive_ratio_limit``, ``AMP_AUTOPSY_MAX_ARCHIVE_RATIO``, else the default).
    """
    return _load(path, mmap, max_ratio, defer=False)[0]


def torch_load_deferred(path: str | os.PathLike, *, mmap: bool = False,
                        max_ratio: float | None = None) -> tuple[Any, Callable[[], None]]:
    """``torch_load_safe``, but the CRC-32 check runs in a second thread while the caller reads the
    object (its zlib releases the GIL): returns ``(obj, verify)``. Call ``verify()`` before using
    anything read from `obj`: it waits for the check and raises its BadInputError if a record is
    damaged (or warns about unchecked large records, as ``check_crcs`` does). If the load itself
    fails, the check's verdict is awaited first and a damaged record is the error raised.

    NB: a file not wholly in the page cache is checked first, as ``torch_load_safe`` does: from
    disk, the check's sequential read brings the file in at the disk's speed, where two readers
    faulting pages in at once took half as long again.
    """
    return _load(path, mmap, max_ratio, defer=True)


def _load(path, mmap: bool, max_ratio: float | None, defer: bool) -> tuple[Any, Callable[[], None]]:
    if max_ratio is not None and not max_ratio > 0:
        raise ValueError(f"max_ratio must be positive, got {max_ratio!r}")
    path = Path(path)
    if not path.exists():
        raise BadInputError("no such file", path=path, fix="check the path")
    if path.is_dir():
        raise BadInputError("is a directory, expected a file", path=path)
    _check_archive(path, max_archive_ratio() if max_ratio is None else max_ratio)
    cached = defer and _in_page_cache(path)
    verify = _crc_check_started(path) if cached else _checked_now(path)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            obj = _torch_load(path, mmap)
        check_nesting(obj, path=path, what="the file's content")
    except BaseException:
        verify()  # a damaged record is the cause of whatever the load met: its error first
        raise
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return obj, verify


def _checked_now(path: Path) -> Callable[[], None]:
    check_crcs(path)
    return lambda: None


def _crc_check_started(path: Path) -> Callable[[], None]:
    """Start ``_crc_verdict(path)`` in a daemon thread; the returned function waits for it and acts on
    it in the caller's thread (raises, or warns: warning filters are not thread-safe)."""
    box: list = []

    def run() -> None:
        try:
            box.append(_crc_verdict(path))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread by verify()
            box.append(e)

    thread = threading.Thread(target=run, name="amp-autopsy-crc32", daemon=True)
    thread.start()

    def verify() -> None:
        thread.join()
        result = box[0]
        if isinstance(result, BaseException):
            raise result
        _act_on(path, *result, stacklevel=3)

    return verify


def _check_archive(path: Path, ratio: float) -> None:
    """Refuse a zip whose declared uncompressed sizes exceed the file by more than the limit."""
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as zf:
            declared = sum(max(0, i.file_size) for i in zf.infolist())
    except ZIP_ERRORS:
        return  # not a zip (or a broken one): torch.load reports it
    if declared > archive_budget(size, ratio):
        raise BadInputError(
            f"refused: the archive declares {declared} bytes uncompressed in a {size}-byte file "
            f"(more than {ratio:g}x; torch.save files are stored uncompressed), "
            "so it looks like a zip bomb",
            path=path, fix=f"if you trust the file, raise the limit with 'analyzer --max-archive-ratio N' "
            f"or {ARCHIVE_RATIO_ENV}=N")


_CHUNK = 1 << 24
CRC_FULL_BYTES = 2 << 30  # files up to 2 GiB of records are checked whole (one more read of each from disk)
CRC_SMALL_RECORD = 1 << 20  # past that, records up to 1 MiB (data.pkl, metadata, small tensors) still are

try:  # zlib-ng's CRC-32 (SIMD carry-less multiply): the same values, ~4x stdlib zlib's speed here
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # no wheel for this platform: stdlib zlib (slower, same values)
    _crc32 = zlib.crc32


def check_crcs(path: Path) -> None:
    """Refuse a zip whose records do not match the CRC-32 its central directory records for them.

    NB: torch.load never checks these (its zip reader skips the CRC), so a flipped byte inside a
    tensor record or in data.pkl loads as a different value in silence. torch.save records the
    CRC of every record unless ``torch.serialization.set_crc32_options(False)``, which writes 0:
    a record whose recorded CRC is 0 is not checked. Stored records (torch.save compresses none)
    are checked where they lie in a read-only map of the file, with no copy; compressed ones
    through ``zipfile``. The check costs one more read of the file, so a file with more than
    ``CRC_FULL_BYTES`` of records has only its records up to ``CRC_SMALL_RECORD`` checked, and
    a warning says that its large tensor records were not.
    """
    _act_on(path, *_crc_verdict(path), stacklevel=4)


def _act_on(path: Path, damaged: BadInputError | None, skipped: int, stacklevel: int) -> None:
    if damaged is not None:
        raise damaged
    if skipped:
        warnings.warn(f"{path}: {skipped} tensor record(s) over {CRC_SMALL_RECORD >> 20} MiB were not "
                      f"checked against their CRC-32 (the file holds more than {CRC_FULL_BYTES >> 30} GiB; "
                      "zipfile.ZipFile(path).testzip() checks them all)", UserWarning, stacklevel=stacklevel)


def _crc_verdict(path: Path, names: set[str] | None = None) -> tuple[BadInputError | None, int]:
    """(the first damaged record's error or None, how many large records went unchecked); raises nothing
    it can pin on the file (a file zipfile cannot open is torch.load's to report). `names`: check
    only these records, whatever their size."""
    try:
        zf = zipfile.ZipFile(path)
    except ZIP_ERRORS:
        return None, 0  # not a zip (or a broken one): torch.load reports it
    with zf:
        infos = [i for i in zf.infolist() if i.CRC != 0 and not i.is_dir()]
        whole = sum(i.file_size for i in infos) <= CRC_FULL_BYTES
        if names is not None:
            infos, whole = [i for i in infos if i.filename in names], True
        skipped = sum(1 for i in infos if not whole and i.file_size > CRC_SMALL_RECORD)
        checked = [i for i in infos if whole or i.file_size <= CRC_SMALL_RECORD]
        with _mapped(zf.fp) as data:
            for info in checked:
                crc = _stored_crc(data, info) if data is not None else None
                if crc is None:  # compressed, or not where the directory says: as zipfile reads it
                    try:
                        _check_record(path, zf, info)
                    except BadInputError as e:
                        return e, skipped
                elif crc != info.CRC:
                    return _damaged(path, info), skipped
    return None, skipped


def _in_page_cache(path: Path, enough: float = 0.9, probes: int = 64, run: int = 16) -> bool:
    """Whether at least `enough` of the file's pages are in the page cache, judged on `probes` evenly
    spaced runs of `run` pages (``mincore``, where libc has it; elsewhere, or for a file that cannot
    be mapped: assumed so). NB: a sample: asking for every page of a 0.5 GB file took half as long
    as reading it from the cache."""
    mincore = _mincore()
    if mincore is None:
        return True
    try:
        with open(path, "rb") as f, _mapped(f) as data:
            if data is None:
                return True
            page = mmap.PAGESIZE
            pages = (len(data) + page - 1) // page
            view = np.frombuffer(data, dtype=np.uint8)  # NB: for its address; nothing is read
            try:
                base, n = view.ctypes.data, min(run, pages)
                vec = (ctypes.c_ubyte * n)()
                seen = resident = 0
                for start in sorted({(pages - n) * i // max(1, probes - 1) for i in range(probes)}):
                    if mincore(ctypes.c_void_p(base + start * page), ctypes.c_size_t(n * page), vec) != 0:
                        return True
                    seen += n
                    resident += sum(b & 1 for b in bytes(vec))  # bit 0: resident
            finally:
                del view  # NB: before _mapped releases the map (an exported buffer keeps it open)
    except OSError:  # a file that cannot be opened: torch.load reports it
        return True
    return resident >= enough * seen


@functools.cache
def _mincore():
    """libc's ``mincore`` from the process's own symbols (Linux, macOS), or None."""
    try:
        return ctypes.CDLL(None).mincore
    except (OSError, AttributeError, TypeError):
        return None


@contextlib.contextmanager
def _mapped(f):
    """A read-only memoryview of the open file `f` (None if it cannot be mapped: empty, a pipe)."""
    try:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        yield None
        return
    view = memoryview(m)
    try:
        yield view
    finally:
        view.release()  # NB: before close: an exported buffer keeps the map open (BufferError)
        m.close()


LOCAL_HEADER = struct.Struct("<4s2xH18xHH")  # a zip local file header: signature, flags, name and extra lengths
_UNREADABLE = 0x1 | 0x20 | 0x40  # encrypted, patched, strongly encrypted: zipfile refuses to read these


def record_start(info: zipfile.ZipInfo, size: int, read: Callable[[int, int], bytes]) -> int | None:
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


def _stored_crc(data: memoryview, info: zipfile.ZipInfo) -> int | None:
    """CRC-32 of a stored record's bytes read in place; None for a compressed record or one whose
    local header or extent does not fit the file (``zipfile`` then reads it, and reports it)."""
    begin = record_start(info, len(data), lambda at, n: data[at:at + n])
    if begin is None:
        return None
    return _crc32(data[begin:begin + info.file_size]) & 0xFFFFFFFF


def _damaged(path: Path, info: zipfile.ZipInfo) -> BadInputError:
    return BadInputError(
        f"damaged: record {info.filename[:120]!r} does not match the CRC-32 it was saved with (its "
        "bytes changed after torch.save wrote them; torch.load would read the changed values without "
        "a word)", path=path, fix="copy the file again from its source, or save it again")


def _check_record(path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
    try:
        f = zf.open(info)
    except (*ZIP_ERRORS, RuntimeError):
        return  # a record zipfile cannot open: torch.load reports it
    try:
        with f:  # zipfile compares the CRC once the record is read to its end
            while f.read(_CHUNK):
                pass
    except zipfile.BadZipFile as e:
        if str(e).startswith("Bad CRC-32"):
            raise _damaged(path, info) from e
    except (OSError, ValueError, EOFError, zlib.error):
        return


def _torch_load(path: Path, mmap: bool) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        glob = re.search(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.]+)", str(e))
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if glob:
            first = f"unsupported global {glob.group(1)}"
            raise BadInputError(
                "refused: the file holds pickled Python objects that would need code execution "
                f"to load ({first[:160]})",
                path=path,
                fix="save plain state_dicts (tensors and primitives) instead of modules or "
                "custom classes; amp-autopsy never loads with weights_only=False",
            ) from e
        raise _unreadable(path) from e  # torch's own words: --debug
    except Exception as e:  # noqa: BLE001 - garbage makes the unpickler raise anything (KeyError, IndexError...)
        raise _unreadable(path) from e


def _unreadable(path: Path) -> BadInputError:
    words = plain_words(path)
    fix = "the file was cut short: copy it again" if words.startswith("truncated") else \
        "copy the file again from its source" if "zip index is damaged" in words else _FIX
    return BadInputError(words, path=path, fix=fix)


_FIX = "pass a file written by torch.save or the amp-autopsy recorder"


def is_zip(path: Path) -> bool:
    """``zipfile.is_zipfile(path)``, False where zipfile raises on a damaged index instead.

    NB: is_zipfile catches only OSError; a damaged zip64 locator raises BadZipFile ("zipfiles that
    span multiple disks are not supported") out of it."""
    try:
        return zipfile.is_zipfile(path)
    except ZIP_ERRORS:
        return False


def plain_words(path: Path) -> str:
    """What is wrong with a file torch cannot read, from its first and last bytes, in plain words.

    Torch's own message (pickle opcodes, miniz errors) is kept in the exception chain, which
    ``analyzer --debug`` prints.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        return f"cannot be read ({type(e).__name__}: {e})"
    if size == 0:
        return "empty file (0 bytes): not a torch file"
    if head.startswith(b"PK\x03\x04"):
        try:
            whole = zipfile.is_zipfile(path)
        except ZIP_ERRORS as e:
            return f"not a readable torch file: its zip index is damaged ({e})"
        if not whole:
            return "truncated: the archive ends before its index"
        return ("not a readable torch file: a complete zip archive whose torch records are corrupt or foreign "
                "(analyzer --debug shows torch's message)")
    if head[:1] == b"\x80":
        return ("not a readable torch file: a pickle stream (a legacy torch file) that is truncated or corrupt "
                "(analyzer --debug shows torch's message)")
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < size:
        return "a .safetensors file, not a torch file (analyzer inspect reads it)"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and all(c.isprintable() or c in "\t\r\n" for c in text):
        start = " ".join(text.split())[:40]
        return f"not a torch file (it starts with text: {start!r})"
    return f"not a torch file (it starts with bytes {head[:8].hex(' ')})"

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
from ._stream import Stream, record_start
from ._limits import ARCHIVE_RATIO_ENV, archive_budget, check_nesting, max_archive_ratio

__all__ = ["torch_load_safe", "torch_load_deferred", "torch_load_streamed", "check_crcs", "is_zip", "ZIP_ERRORS",
           "LayoutMismatch"]

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


STREAM_MIN_BYTES = 64 << 20  # smaller files gain little from following the read: loaded as before


class LayoutMismatch(Exception):
    """``torch_load_streamed``'s object did not map the bytes torch.load maps: load it again unstreamed."""


def torch_load_streamed(path: str | os.PathLike, after: Any = None) -> tuple[Any, Callable[[], None], Any] | None:
    """``torch_load_deferred(path, mmap=True)`` for a zip-format file of at least ``STREAM_MIN_BYTES``
    that is not in the page cache: (the object, ``verify``, the ``Stream`` reading the file), or None
    for any other file (load it with ``torch_load_deferred``).

    One thread reads the file front to back at the disk's speed and checks every stored record's
    CRC-32 as it passes; call ``stream.wait(end)`` before reading a tensor whose storage ends at byte
    `end` of the file (``storage_end``), so the reads follow it instead of racing it. The object is
    loaded with each record's offset computed from torch.save's layout
    (``calculate_storage_offsets``), since reading every record's local header first would scatter
    reads ahead of the reader. ``verify()`` waits for the read, raises for a damaged record as
    ``check_crcs`` does, then loads the file again the usual way (from the page cache now) and
    raises ``LayoutMismatch`` if any tensor maps other bytes: then everything read from the object
    must be thrown away and the file loaded with ``torch_load_deferred``. `after`: a Stream to let
    finish before this one starts reading (two files on one disk).
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
    stream = Stream(path, infos, _crc32, after)

    def outcome() -> tuple[BadInputError | None, int]:
        damaged, later = stream.result()
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

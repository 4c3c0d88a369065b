"""Read a ``.safetensors`` file without the safetensors package: validated header, mmap'd tensors.

Format: an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}?}``,
then the raw little-endian tensor bytes; offsets are relative to the end of the header.
Nothing in the file is executed; every offset is checked against the file size before mapping,
so a truncated file is an error here, not a crash later. Hostile headers (booleans for integers,
dimensions past 2**48, overlapping tensors, deep JSON nesting, huge numbers) are one BadInputError.
A tensor that starts off its dtype's alignment is mapped where it lies: the torch scan reads it there.

Memory grows with the tensor count, not the bytes (a 20 MB header may list 300,000 empty tensors):
each entry is parsed into a tuple rather than a dict, empty tensors of one dtype and shape share one
view, and Python's cyclic garbage collector is paused while the header's many small containers are
built (it would walk them all again and again, for nothing: they hold no cycles).
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
import warnings
from pathlib import Path

import torch

from ..errors import BadInputError
from ._limits import gc_paused as _gc_paused

__all__ = ["looks_like_safetensors", "load_safetensors"]

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}
_MAX_HEADER = 100_000_000  # the safetensors reference implementation's own limit
_MAX_DIMS = 64             # torch's own limit on dimensions
_MAX_DIM = 1 << 48         # a larger dimension cannot be real data, and products of such overflow int64
_FIX = "re-export it with safetensors.torch.save_file, or pass a torch.save'd state_dict"


def looks_like_safetensors(path: str | os.PathLike) -> bool:
    """True when the file starts like safetensors: a plausible header length, then ``{``."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if len(head) < 9 or head[8:9] != b"{":
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= min(_MAX_HEADER, size - 8)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is a Python int too


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _bad(path: Path, what: str) -> BadInputError:
    return BadInputError(f"not a valid safetensors file: {what}", path=path, fix=_FIX)


class _Duplicate(ValueError):
    pass


_SPEC_KEYS = frozenset(("dtype", "shape", "data_offsets"))


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict | tuple:
    """A JSON object as a dict; a tensor's entry (exactly its three keys) as ``(dtype, shape, data_offsets)``,
    a third of the dict's size. Refuses a key given twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        raise _Duplicate(next(k for k, _ in pairs if k in seen or seen.add(k)))
    if len(out) == 3 and out.keys() == _SPEC_KEYS:
        return out["dtype"], out["shape"], out["data_offsets"]
    return out


def _header(path: Path, f, size: int) -> tuple[int, dict]:
    head = f.read(8)
    if len(head) < 8:
        raise _bad(path, f"only {size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER or 8 + n > size:
        raise _bad(path, f"header length {n} does not fit in the {size}-byte file (truncated?)")
    try:
        with _gc_paused():
            header = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except _Duplicate as e:
        raise _bad(path, f"the header names tensor {_short(e.args[0])} twice (a writer would not; which one is "
                         "meant is unknown)") from e
    except RecursionError as e:
        raise _bad(path, "header JSON is nested too deeply") from e
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, and numbers past int's digit limit
        raise _bad(path, f"header is not JSON ({' '.join(str(e).split())[:160]})") from e
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    return 8 + n, header


def _entry(path: Path, name: str, spec, data_len: int) -> tuple[torch.dtype, list[int], int, int]:
    if isinstance(spec, tuple):  # _no_duplicates' form of {"dtype", "shape", "data_offsets"}
        code, shape, offsets = spec
    elif isinstance(spec, dict):  # a key missing or one too many: named below
        code, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    else:
        raise _bad(path, f"entry {name!r} is not an object")
    dtype = _DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise _bad(path, f"tensor {name!r} has unknown dtype {_short(code)}")
    if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS
            and all(_is_int(d) and 0 <= d <= _MAX_DIM for d in shape)):
        raise _bad(path, f"tensor {name!r} has a bad shape {_short(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise _bad(path, f"tensor {name!r} has bad data_offsets {_short(offsets)}")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= 2**62:
        raise _bad(path, f"tensor {name!r} declares {nbytes} bytes ({_short(shape)})")
    if not 0 <= begin <= end or end - begin != nbytes:
        raise _bad(path, f"tensor {name!r}: data_offsets {offsets} do not hold {shape} x {code}")
    if end > data_len:
        raise _bad(path, f"tensor {name!r} ends at byte {end} but the data is {data_len} bytes (truncated?)")
    return dtype, shape, begin, end


def _check_overlap(path: Path, entries: dict) -> None:
    """Two tensors sharing bytes are not something safetensors writes: refuse rather than guess."""
    spans = sorted((begin, end, name) for name, (_, _, begin, end) in entries.items() if end > begin)
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise _bad(path, f"tensors {a!r} and {b!r} overlap in the data (bytes {begin_b}..{end_a})")


def load_safetensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Map every tensor of a safetensors file (copy-on-write mmap, nothing read yet) and its metadata.

    Example:
        >>> tensors, meta = load_safetensors("model.safetensors")  # doctest: +SKIP
        >>> tensors["lm_head.weight"].dtype  # doctest: +SKIP
        torch.bfloat16
    """
    path = Path(path)
    if not path.is_file():
        raise BadInputError("no such file", path=path, fix="check the path")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start, header = _header(path, f, size)
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise _bad(path, "__metadata__ is not an object")
        with _gc_paused():
            entries = {name: _entry(path, name, spec, size - start) for name, spec in header.items()}
        del header  # NB: memory grows with the tensor count (a small file may hold 100k): keep one copy
        _check_overlap(path, entries)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > start else None
    tensors, empty = {}, {}
    with warnings.catch_warnings(), _gc_paused():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer's "non-writable" note: it is copy-on-write
        for name, (dtype, shape, begin, end) in sorted(entries.items(), key=lambda kv: kv[1][2]):
            count = end - begin
            if count == 0:  # one view per dtype and shape: no storage of its own, shared by every such name
                key = (dtype, tuple(shape))
                view = empty.get(key)
                if view is None:
                    base = empty.get(dtype)
                    if base is None:
                        base = empty[dtype] = torch.empty(0, dtype=dtype)
                    view = empty[key] = base.view(shape)
                tensors[name] = view
            else:  # NB: possibly off its alignment (packed back to back): the scan reads it in place
                t = torch.frombuffer(mm, dtype=dtype, count=count // dtype.itemsize, offset=start + begin)
                tensors[name] = t.reshape(shape)
    return tensors, {str(k): str(v) for k, v in meta.items()}

"""Open a checkpoint of any accepted layout and list its tensors with their roles.

Accepted: a ``torch.save``d state_dict or tensor, a training-checkpoint dict (model / optimizer /
scaler entries found wherever they sit), a ``.safetensors`` file, amp-autopsy snapshots, and HF
Trainer ``checkpoint-N/`` directories (``hf_checkpoint``).
Loading is ``weights_only=True`` (and ``mmap=True`` for zip-format files): nothing in the file runs,
and tensor bytes are read only when scanned.

Roles: ``weight`` (parameters of a state_dict), ``buffer`` (BatchNorm running stats and other
non-parameters), ``optimizer`` (per-parameter optimizer state), ``input`` (a snapshot's batch),
``other`` (loose tensors elsewhere in a checkpoint).
"""
from __future__ import annotations

import math
import os
import re
import struct
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from recorders import schema

from ..errors import BadInputError
from ._ckvalues import read_scaler, read_step
from ._limits import MAX_NESTING, gc_paused
from ._optimizer_state import BUFFER, FIX, OptimizerInfo, is_optimizer_state, join, named_state_dict, read_optimizer
from ._stream import storage_end, torch_load_streamed
from .torchfile import ZIP_ERRORS, torch_load_deferred, torch_load_safe
from .versions import check_format_version
from .safetensors import load_safetensors, looks_like_safetensors

__all__ = ["Entry", "OptimizerInfo", "Checkpoint", "load_checkpoint_file"]

_STEP_KEYS = ("step", "global_step", "iteration", "iter_num", "iter", "epoch")


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint. For optimizer state, `param` names the parameter and `slot` the buffer."""

    name: str
    role: str
    tensor: torch.Tensor
    param: str | None = None
    slot: str | None = None


@dataclass
class Checkpoint:
    """A loaded checkpoint: its tensors (mmap'd where possible) and what was found around them."""

    path: str
    format: str          # "torch" (zip), "torch-legacy", "safetensors"
    layout: str          # "state_dict", "training_checkpoint", "snapshot", "safetensors", "tensor"
    nbytes: int
    entries: list[Entry] = field(default_factory=list)
    step: int | None = None
    step_key: str | None = None
    model_paths: list[str] = field(default_factory=list)
    optimizers: list[OptimizerInfo] = field(default_factory=list)
    scaler: dict[str, Any] | None = None
    non_floating: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # files read briefly or skipped (an HF checkpoint directory)
    # values no training run saves, each "where: what" (a GradScaler scale that is not a positive
    # finite number, a step of NaN or 2**100): not used, and named by inspect's implausible_checkpoint
    implausible: list[str] = field(default_factory=list)
    # waits for the CRC-32 check of a file loaded with defer_crc=True (raises if a record is damaged);
    # a no-op otherwise. NB: call it before reporting anything read from the tensors.
    verify: Callable[[], None] = field(default=lambda: None, repr=False, compare=False)
    # stream=True, a file not in the page cache: the thread reading it front to back (``Stream``);
    # ``wait(t)`` returns once tensor t's bytes are read. NB: verify() may then raise LayoutMismatch.
    stream: Any = field(default=None, repr=False, compare=False)

    def wait(self, t: torch.Tensor) -> None:
        if self.stream is not None:
            self.stream.wait(storage_end(self.stream, t))


def _is_scaler_state(d: Any) -> bool:
    """A GradScaler state_dict, by its keys (whatever its scale holds: ``read_scaler`` judges that)."""
    return isinstance(d, dict) and "scale" in d and ("_growth_tracker" in d or "growth_factor" in d)


def _is_tensor_dict(d: Any) -> bool:
    """A state_dict: string keys, tensor values (``*_extra_state`` entries aside)."""
    if not isinstance(d, dict) or not d:
        return False
    values = [v for k, v in d.items() if not str(k).endswith("_extra_state")]
    return bool(values) and all(isinstance(k, str) for k in d) and all(isinstance(v, torch.Tensor) for v in values)


class _Walker:
    """Collects entries, state_dicts, optimizers and scalers from a loaded object tree."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self.models: list[tuple[str, dict]] = []
        self.optims: list[tuple[str, dict]] = []
        self.seen: set[int] = set()  # containers already walked: a pickle can share one many times over

    def add(self, name: str, role: str, t: torch.Tensor, **kw) -> None:
        if t.is_floating_point() and t.layout == torch.strided:
            self.ckpt.entries.append(Entry(name, role, t, **kw))
        else:  # integer, bool, complex, quantized, sparse: counted, not scanned
            self.ckpt.non_floating += 1

    def walk(self, obj: Any, path: str, role: str = "other", depth: int = 0) -> None:
        if depth > MAX_NESTING:  # torch_load_safe refuses this already; safetensors and callers' objects not
            raise BadInputError(f"containers nested more than {MAX_NESTING} deep (at {path[:120]!r})",
                                path=self.ckpt.path, fix=FIX)
        if isinstance(obj, torch.Tensor):
            self.add(path or "tensor", role, obj)
        elif is_optimizer_state(obj):
            self.optims.append((path, obj))
        elif _is_scaler_state(obj):
            read_scaler(obj, path, self.ckpt)
        elif _is_tensor_dict(obj) and role != "input":
            self.models.append((path, obj))
            self.ckpt.model_paths.append(path)
            for k, v in obj.items():
                if isinstance(v, torch.Tensor):
                    self.add(join(path, k), "buffer" if BUFFER.search(k) else "weight", v)
        elif isinstance(obj, (dict, list, tuple)) and id(obj) in self.seen:
            return
        elif isinstance(obj, dict):
            self.seen.add(id(obj))
            for k, v in zip(_key_names(obj), obj.values()):
                self.walk(v, join(path, k), role, depth + 1)
        elif isinstance(obj, (list, tuple)):
            self.seen.add(id(obj))
            for i, v in enumerate(obj):
                self.walk(v, join(path, i), role, depth + 1)


# Lightning's callback state keys are the callback's class and a repr of its arguments:
# "ModelCheckpoint{'monitor': None, 'mode': 'min', ...}". A tensor is named by the class instead.
_STATE_KEY = re.compile(r"^([A-Za-z_][\w.]*)\{.*\}$", re.DOTALL)


def _key_names(d: dict) -> list:
    """The path element of each key of `d`: the key, or for a repr-like state key its class name
    (``ModelCheckpoint``; ``ModelCheckpoint[1]`` for a second one in the same dict)."""
    out, taken = [], set(k for k in d if isinstance(k, str) and not _STATE_KEY.match(k))
    for k in d:
        m = _STATE_KEY.match(k) if isinstance(k, str) else None
        if m is None:
            out.append(k)
            continue
        name, i = m[1], 0
        while name in taken:
            i += 1
            name = f"{m[1]}[{i}]"
        taken.add(name)
        out.append(name)
    return out


def _find_step(obj: Any, ckpt: Checkpoint) -> None:
    if not isinstance(obj, dict):
        return
    for key in _STEP_KEYS:
        v = obj.get(key)
        if v is None or key == "epoch" and isinstance(v, float) and math.isfinite(v) and v >= 0:
            continue  # a fractional epoch (2.5) is a real one, but no step count
        step = read_step(v, key, ckpt)
        if step is not None:
            ckpt.step, ckpt.step_key = step, key
            return


def _refuse_archives(path: Path) -> None:
    """TorchScript and torch.export archives are zip files too, but programs, not checkpoints."""
    try:
        with zipfile.ZipFile(path) as zf:  # (closed here, not whenever it is collected)
            names = zf.namelist()
    except ZIP_ERRORS:
        return  # torch_load_safe gives the one-line error
    if any(n.endswith("/constants.pkl") for n in names):
        what = "a TorchScript archive (torch.jit.save): loading it would run its code"
    elif any(n.endswith("/archive_format") for n in names):
        what = "a torch.export archive (.pt2), a program rather than a checkpoint"
    else:
        return
    raise BadInputError(f"refused: {what}", path=path,
                        fix="torch.save(model.state_dict()) from the original model and inspect that")


def _read(path: Path, defer_crc: bool = False, stream: bool = False,
          beside: Any = None) -> tuple[Any, str, Callable[[], None] | None, Any]:
    """Load the object tree: mmap'd zip-format torch files, legacy torch files, or safetensors; the
    deferred CRC-32 check's ``verify`` (`defer_crc`, zip-format torch files only) or None; and the
    ``Stream`` reading the file (`stream`, a large zip-format file not in the page cache) or None."""
    if not path.is_file():
        raise BadInputError("no such file" if not path.exists() else "is not a regular file", path=path,
                            fix="check the path")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PK\x03\x04":
        _refuse_archives(path)
        if stream and (streamed := torch_load_streamed(path, beside)) is not None:
            obj, verify, reader = streamed
            return obj, "torch", verify, reader
        if defer_crc:
            obj, verify = torch_load_deferred(path, mmap=True)
            return obj, "torch", verify, None
        return torch_load_safe(path, mmap=True), "torch", None, None
    if path.suffix == ".safetensors" or looks_like_safetensors(path):
        tensors, meta = load_safetensors(path)
        return (tensors, meta), "safetensors", None, None
    if magic[:1] != b"\x80":  # a legacy torch file is a pickle stream, which starts with PROTO
        raise BadInputError(f"not a torch or safetensors file (starts with {magic!r})", path=path, fix=FIX)
    # NB: mmap needs the zip format (torch >= 1.6 default); older files load into memory.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "Detected pickle protocol ..." on garbage
            return torch_load_safe(path, mmap=False), "torch-legacy", None, None
    except (KeyError, IndexError, TypeError, struct.error, UnicodeDecodeError) as e:
        # the weights-only unpickler raises these on garbage that torch_load_safe does not expect
        raise BadInputError(f"corrupt legacy torch file ({type(e).__name__}: {e})", path=path, fix=FIX) from e


def _check_snapshot(obj: dict, path: Path) -> None:
    check_format_version(obj, path=path, what="snapshot")


def load_checkpoint_file(path: str | os.PathLike, *, defer_crc: bool = False, stream: bool = False,
                         beside: Any = None) -> Checkpoint:
    """Open the checkpoint file `path` and list its tensors by role (directories: ``load.checkpoints``). Raises BadInputError / VersionError with a fix.

    `defer_crc`: the CRC-32 check of a zip-format torch file runs in a second thread while the
    caller reads the tensors; ``ckpt.verify()`` waits for it and raises if a record is damaged.
    `stream` (with `defer_crc`): a large zip-format file not in the page cache is read front to back
    by one thread (``_stream.torch_load_streamed``), taking turns with `beside` (another file's
    ``ckpt.stream``); read each tensor after ``ckpt.wait(tensor)``, and reload the file unstreamed
    if ``verify()`` raises ``LayoutMismatch``.

    Example:
        >>> ckpt = load_checkpoint_file("ckpt.pt")  # doctest: +SKIP
        >>> [(e.name, e.role) for e in ckpt.entries][:2]  # doctest: +SKIP
        [('model.fc.weight', 'weight'), ('model.fc.bias', 'weight')]
    """
    path = Path(path)
    obj, fmt, verify, reader = _read(path, defer_crc, stream, beside)
    try:
        with gc_paused():  # one Entry per tensor, and a small file may list 300,000
            ckpt = _checkpoint(path, obj, fmt, verify)
        ckpt.stream = reader
        return ckpt
    except BaseException:
        if verify is not None:
            verify()  # a damaged record explains whatever reading the object met: its error first
        raise


def _checkpoint(path: Path, obj: Any, fmt: str, verify: Callable[[], None] | None) -> Checkpoint:
    ckpt = Checkpoint(path=os.fspath(path), format=fmt, layout="training_checkpoint", nbytes=path.stat().st_size)
    if verify is not None:
        ckpt.verify = verify
    walker = _Walker(ckpt)
    if fmt == "safetensors":
        tensors, ckpt.metadata = obj
        ckpt.layout = "safetensors"
        walker.walk(tensors, "")
    elif isinstance(obj, torch.Tensor):
        ckpt.layout = "tensor"
        walker.walk(obj, "")
    elif isinstance(obj, dict) and obj.get("format") == schema.SNAPSHOT_FORMAT:
        _check_snapshot(obj, path)
        ckpt.layout, ckpt.step_key = "snapshot", "step"
        ckpt.step = read_step(obj.get("step"), "step", ckpt)
        walker.walk(obj.get("model_state"), "model_state")
        walker.walk(obj.get("batch"), "batch", role="input")
        if isinstance(obj.get("scaler_state"), dict):
            walker.walk(obj["scaler_state"], "scaler_state")
        if isinstance(obj.get("optimizer"), dict) and is_optimizer_state(obj["optimizer"].get("state_dict")):
            walker.optims.append(("optimizer", named_state_dict(obj["optimizer"])))  # since format 3
        if ckpt.scaler is None and obj.get("scale") is not None:
            read_scaler({"scale": obj["scale"]}, "scale", ckpt)
    else:
        if _is_tensor_dict(obj):
            ckpt.layout = "state_dict"
        _find_step(obj, ckpt)
        walker.walk(obj, "")
    ckpt.optimizers = [read_optimizer(walker, p, o) for p, o in walker.optims]
    if not ckpt.entries:
        keys = [k if isinstance(k, (int, str)) and len(str(k)) <= 40 else f"{str(k)[:37]}..."
                for k in list(obj)[:8]] if isinstance(obj, dict) else type(obj).__name__
        raise BadInputError(f"unknown layout: no floating-point tensors found (top level: {keys})",
                            path=path, fix=FIX)
    return ckpt

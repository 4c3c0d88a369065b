"""Read a recorder snapshot (one failing step, ``RUN/snapshots/*.pt``): version check and validation.

User-code references in it are resolved by ``refs``; the file itself is read by ``torchfile``.
"""
from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from recorders import schema

from ..errors import BadInputError
from ._micro import validate_micro_batches
from ._rewind import validate_rewind
from ._snapshot_sense import snapshot_notes
from ._validate import validate_snapshot
from .torchfile import torch_load_safe
from .compiled import clean_old_names
from .versions import check_format_version
from .which import directory_given_to_replay

__all__ = ["Snapshot", "load_snapshot"]


@dataclass(frozen=True, eq=False)
class Snapshot(Mapping):
    """A validated recorder snapshot: one attribute per ``schema.SNAPSHOT_KEYS`` key, values checked.

    Every value has been validated by ``load_snapshot`` (types, ranges, dense tensors, a real
    generator state), so readers use the attributes and check nothing again. Keys that files of
    older versions lack (``schema.KEYS_ADDED``, e.g. ``cwd``) are None. It is also a read-only
    mapping of the file's own keys (``snap["step"]``), for code written against the raw dict.

    Example:
        >>> snap = load_snapshot("run/snapshots/step00000013-r00000-nonfinite_loss.pt")  # doctest: +SKIP
        >>> snap.step, snap.reason, snap.factory                                          # doctest: +SKIP
        (13, 'nonfinite_loss', 'samples.models:build_gpt')
    """

    path: str
    format: str
    format_version: int
    torch_version: str
    amp_autopsy_version: str | None
    created: float
    host: str | None
    rank: int
    world_size: int
    step: int
    reason: str
    device_type: str
    amp_dtype: str | None
    scale: float | None
    scaler_state: dict | None
    factory: str | None
    factory_kwargs: dict | None
    loss_fn: str | None
    train_mode: bool
    model_state: dict = field(repr=False)
    batch: Any = field(repr=False)
    rng: dict = field(repr=False)
    loss: float | None
    loss_dtype: str | None
    grad_norm: float | None
    cwd: str | None
    sdpa: dict | None  # since version 3: the SDPA backend switches (recorders/_sdpa.py)
    fsdp: dict | None  # since version 3: a sharded (FSDP2) model's DCP directory or local shards
    optimizer: dict | None = field(repr=False)  # since version 3: class, state_dict, param_names
    update: dict | None = field(repr=False)  # since version 3, reason "update": grads, post_params, nonfinite_params
    _raw: Mapping = field(repr=False)
    exception: dict | None = None  # since version 4, reason "exception": type, message, frames, step (load/exceptions.py)
    compile: dict | None = None  # since version 5: how training torch.compile'd the model (load/compiled.py)
    micro_batches: dict | None = None  # since version 6: batch lists the step's micro-batches (load/_micro.py)
    # values a replay can use but no ordinary run records (a loss scale of 1e30, integer weights beside
    # float ones), one sentence each (load/_snapshot_sense.py): print them before any verdict
    load_notes: tuple[str, ...] = ()
    spike: dict | None = None  # since version 7, reasons loss_spike / grad_spike: schema.SPIKE_KEYS (recorders/_spikes.py)
    rewind: dict | None = field(default=None, repr=False)  # since version 8, Recorder(rewind=K): load/_rewind.py
    fp8_recipe: dict | None = None  # since version 8: the torchao FP8 recipe (recorders/fp8_recipe.py)
    fp8: dict | None = None  # since version 8: the step's FP8 casts, schema.FP8_KEYS (recorders/_fp8_watch.py)
    ddp: dict | None = None  # since version 9: what shapes DDP's gradient all-reduce, schema.DDP_KEYS (load/ddp.py)

    @property
    def has_scaler(self) -> bool:
        """Whether the run trained with a GradScaler (its state or its scale was recorded)."""
        return self.scaler_state is not None or self.scale is not None

    def __getitem__(self, key: str) -> Any:
        return self._raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __reduce__(self):
        """Pickled with its raw entries as a plain dict (the ranks of a distributed replay share one)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["_raw"] = dict(self._raw)
        return _unpickle_snapshot, (values,)


def _unpickle_snapshot(values: dict) -> Snapshot:
    return Snapshot(**dict(values, _raw=MappingProxyType(values["_raw"])))



def _fp8_uses(snap: dict) -> dict:
    """`snap` with a ``use`` in each FP8 cast of a format-8 snapshot: its casts name none and measured each role's
    first use (``schema.FP8_FIRST_USE``). Validated before: casts and fired are dicts or None."""
    fp8 = snap.get("fp8")
    version = snap.get("format_version")
    if not isinstance(fp8, dict) or not isinstance(version, int) or version >= 9:
        return snap

    def named(c):
        return c if not isinstance(c, dict) or "use" in c else {**c, "use": schema.FP8_FIRST_USE.get(c.get("role"))}

    fp8 = {k: ([named(c) for c in v] if k == "casts" and isinstance(v, list) else named(v) if k == "fired" else v)
           for k, v in fp8.items()}
    return {**snap, "fp8": fp8}


def load_snapshot(path: str | os.PathLike) -> Snapshot:
    """Load and validate a recorder snapshot into a ``Snapshot``. Raises BadInputError / VersionError."""
    if os.path.isdir(path):  # a run directory: name its first failing snapshot and autopsy
        raise directory_given_to_replay(Path(path))
    snap = torch_load_safe(path)
    if not isinstance(snap, dict) or snap.get("format") != schema.SNAPSHOT_FORMAT:
        raise BadInputError(
            "not an amp-autopsy snapshot (no 'format': 'amp-autopsy.snapshot' key)",
            path=path,
            fix="pass a .pt file from RUN_DIR/snapshots/; for checkpoints use 'analyzer inspect'",
        )
    check_format_version(snap, path=path, what="snapshot")
    # keys added after version 1 (schema.KEYS_ADDED, e.g. cwd) are optional: older snapshots lack them
    missing = [k for k in schema.SNAPSHOT_KEYS if k not in snap and k not in schema.KEYS_ADDED]
    if missing:
        raise BadInputError(f"snapshot lacks keys {missing}", path=path, fix="re-record the run")
    validate_snapshot(snap, path)
    notes = snapshot_notes(snap, path)
    validate_micro_batches(snap, path)
    validate_rewind(snap, path)
    snap = clean_old_names(snap)  # a compiled model's snapshot older than version 5: no _orig_mod. names
    snap = _fp8_uses(snap)
    return Snapshot(path=os.fspath(path), **{k: snap.get(k) for k in schema.SNAPSHOT_KEYS},
                    _raw=MappingProxyType(snap), load_notes=tuple(notes))

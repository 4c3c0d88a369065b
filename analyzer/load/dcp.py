"""The whole model of a sharded (FSDP2) snapshot: its DCP directory consolidated, or every rank's shards joined.

A snapshot of a ``fully_shard``-ed model keeps ``model_state`` empty and says in its ``fsdp``
key where the weights are (``recorders/_fsdp.py``):

- ``dcp_dir``: a ``torch.distributed.checkpoint`` directory next to the snapshot, written by
  every rank together (``sync_failures=True``), holding ``{"model": ..., "optim": ...}``.
  It is read here in this one process, as ``dcp_to_torch_save`` would read it, with two
  changes that keep the rule that no code from a file runs: its ``.metadata`` pickle is
  unpickled with an allow-list of DCP's own metadata classes (``dcp_to_torch_save`` calls
  ``pickle.load``), and non-tensor items are read with ``weights_only=True`` (it uses
  ``weights_only=False``). Only the ``model`` part is loaded. Memory is bounded before anything
  is allocated: the tensors the metadata declares may not exceed the bytes of its data files.
- ``local_state`` and ``layout``: each failing rank saved its own shards without a collective.
  The whole model is assembled from every rank's snapshot file of the same step; it exists
  only if every rank wrote one.

Nothing is written: the consolidated state stays in memory, and no input is modified.

Example:
    >>> state = load_sharded_state("run/snapshots/step00000002-r00001-nonfinite_loss.pt", snap)  # doctest: +SKIP
    >>> state["0.weight"].shape                                                                  # doctest: +SKIP
    torch.Size([8, 8])
"""
from __future__ import annotations

import io
import os
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from recorders import schema

from ..errors import BadInputError
from ._limits import archive_budget, check_nesting
from ._dense import check_dense

__all__ = ["load_sharded_state", "sibling_snapshot", "dcp_directory", "read_dcp_metadata"]

_RERECORD = ("record with Recorder(..., sync_failures=True) so that every rank writes the step's "
             "shards into one DCP directory, then replay that snapshot")
# recorders.triggers.REASONS (the recorder's priority order), then the other automatic reasons
_REASON_ORDER = (schema.NONFINITE_LOSS, schema.NONFINITE_GRADS, schema.SCALE_COLLAPSE, schema.OVERFLOW_STREAK,
                 schema.REASON_EXCEPTION, schema.PEER_FAILURE, schema.UPDATE)
_MAX_METADATA = 64 << 20  # a DCP .metadata of 64 MiB describes millions of tensors
_META = "torch.distributed.checkpoint.metadata"
# The globals a DCP .metadata pickle names (torch 2.x); anything else is refused unloaded.
_ALLOWED = {
    (_META, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                         "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
}


def sibling_snapshot(path: str | os.PathLike, rank: int) -> Path:
    """The snapshot file of the same step and writer written by `rank` (``--rank``, the FSDP2 join).

    The sibling need not share the reason: without ``sync_failures`` the rank whose batch went NaN
    writes ``nonfinite_loss`` while the rank that only received NaN gradients through the
    reduce-scatter writes ``nonfinite_grads``. The same reason is preferred, then the automatic
    reasons in the recorder's priority order; a ``manual`` snapshot stands in only for a manual one.
    """
    path = Path(path)
    m = schema.SNAPSHOT_RE.match(path.name)
    if m is None:
        raise BadInputError("the file name is not a recorder snapshot's (stepNNNNNNNN-rNNNNN-REASON.pt), so "
                            "its rank's siblings cannot be found", path=path, fix="pass the rank's file itself")
    step, _, writer, reason = m.groups()
    same = path.with_name(f"step{step}-r{rank:05d}{'' if writer is None else f'-w{writer}'}-{reason}.pt")
    if same.is_file():
        return same
    found = [(g, p) for p in path.parent.iterdir() if p.is_file() and (g := schema.SNAPSHOT_RE.match(p.name))]
    of_step = [(g, p) for g, p in found if (g[1], g[3]) == (step, writer)]
    mine = [(g[4], p) for g, p in of_step if int(g[2]) == rank and (g[4] != schema.MANUAL or reason == g[4])]
    if mine:
        order = {r: i for i, r in enumerate(_REASON_ORDER)}
        return min(mine, key=lambda rp: (order.get(rp[0], len(order)), rp[0]))[1]
    have = sorted({int(g[2]) for g, _ in of_step})
    raise BadInputError(
        f"rank {rank} wrote no snapshot of step {int(step)}: no trigger fired on that rank at this step (its "
        "gradients and loss stayed finite, or its max_snapshots was spent)", path=path.parent,
        fix=(f"pick one of the ranks that wrote this step ({have}); to have every rank snapshot a failing "
             "step, record with Recorder(..., sync_failures=True)" if have else _RERECORD))


def load_sharded_state(path: str | os.PathLike, snap: Mapping) -> dict[str, torch.Tensor] | None:
    """The whole (unsharded) model state of an FSDP snapshot; None for any other snapshot.

    Raises:
        BadInputError: the DCP directory is missing, corrupt or foreign, or a rank's shards are missing.
    """
    fsdp = snap.get("fsdp")
    if fsdp is None:
        return None
    if not isinstance(fsdp, Mapping):
        raise BadInputError(f"snapshot 'fsdp' should be a dict or None, got {type(fsdp).__name__}", path=path,
                            fix="re-record the run")
    dcp_dir = fsdp.get("dcp_dir")
    if dcp_dir is not None:
        return _from_dcp(path, _dcp_path(path, dcp_dir))
    if fsdp.get("local_state") is not None:
        return _from_local_shards(path, snap)
    raise BadInputError("this FSDP snapshot holds neither a DCP directory nor its rank's shards", path=path,
                        fix=_RERECORD)


def dcp_directory(path: str | os.PathLike, snap: Mapping) -> Path:
    """The snapshot's DCP directory beside it, checked to be a plain name there (the distributed replay's weights).

    Raises:
        BadInputError: not an FSDP snapshot, no DCP directory (local shards only), or a missing or hostile one.
    """
    fsdp = snap.get("fsdp")
    if not isinstance(fsdp, Mapping):
        raise BadInputError("not a sharded (FSDP2) snapshot: it has no fsdp entry", path=path,
                            fix="replay it in one process: analyzer replay SNAPSHOT, without torchrun")
    if fsdp.get("dcp_dir") is None:
        raise BadInputError("this FSDP snapshot holds its rank's local shards, not a DCP directory, which the "
                            "distributed replay loads", path=path,
                            fix="replay it in one process (analyzer replay SNAPSHOT, without torchrun), or " + _RERECORD)
    return _dcp_path(path, fsdp["dcp_dir"])


def read_dcp_metadata(d: Path):
    """The DCP directory's ``.metadata`` through the allow-list, every storage item checked to lie in its data files.

    Raises:
        BadInputError: a missing, corrupt, truncated or foreign DCP directory.
    """
    md = _read_metadata(d)
    _check_storage(d, md)
    if not any(isinstance(k, str) and k.startswith("model.") for k in md.state_dict_metadata):
        raise BadInputError("the DCP checkpoint holds no 'model' state", path=d, fix=_RERECORD)
    return md


# -- DCP directories ------------------------------------------------------------------------------
def _dcp_path(path, name) -> Path:
    """The DCP directory, which must be a plain name beside the snapshot (never a path elsewhere)."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise BadInputError(f"snapshot fsdp.dcp_dir {name!r} is not a directory name beside the snapshot"[:300],
                            path=path, fix="re-record the run")
    folder = Path(path).parent
    d = folder / name
    if not d.is_dir():
        raise BadInputError(f"the snapshot's DCP directory {name} is missing", path=d,
                            fix="copy the whole snapshots/ folder, DCP directories included, or " + _RERECORD)
    if d.resolve().parent != folder.resolve():
        raise BadInputError("the DCP directory links outside the snapshot's folder", path=d,
                            fix="copy the DCP directory itself beside the snapshot")
    return d


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def _read_metadata(d: Path):
    from torch.distributed.checkpoint.metadata import Metadata

    f = d / ".metadata"
    if not f.is_file():
        raise BadInputError("not a DCP checkpoint (no .metadata file)", path=d, fix=_RERECORD)
    if f.stat().st_size > _MAX_METADATA:
        raise BadInputError(f"the DCP .metadata is larger than {_MAX_METADATA >> 20} MiB", path=f,
                            fix="the directory is damaged or foreign; " + _RERECORD)
    try:
        md = _MetadataUnpickler(io.BytesIO(f.read_bytes())).load()
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a corrupt or foreign file
        raise BadInputError(f"unreadable DCP metadata ({type(e).__name__}: {str(e)[:120]})", path=f,
                            fix="the directory is damaged, truncated or foreign; " + _RERECORD) from e
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise BadInputError("the DCP .metadata is not a checkpoint's metadata", path=f, fix=_RERECORD)
    return md


def _check_storage(d: Path, md) -> None:
    """Every item read lies inside a data file of `d`; the model's declared bytes fit those files."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    sizes: dict[str, int] = {}
    for idx, info in md.storage_data.items():
        rel = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(rel, str) or os.path.basename(rel) != rel \
                or rel in ("", ".", ".."):
            raise BadInputError(f"the DCP metadata points outside its directory ({rel!r})"[:300], path=d,
                                fix=_RERECORD)
        if getattr(info, "transform_descriptors", None):
            raise BadInputError("the DCP checkpoint is compressed or transformed, which replay does not read",
                                path=d, fix="save it with the default (uncompressed) FileSystemWriter")
        if rel not in sizes:
            f = d / rel
            if not f.is_file():
                raise BadInputError(f"the DCP data file {rel} is missing", path=d,
                                    fix="copy the whole DCP directory, or " + _RERECORD)
            sizes[rel] = f.stat().st_size
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0
                and info.length >= 0 and info.offset + info.length <= sizes[rel]):
            raise BadInputError(f"the DCP data file {rel} is shorter than its metadata says (truncated?)",
                                path=d / rel, fix=_RERECORD)
    declared = 0
    for key, meta in md.state_dict_metadata.items():
        if not (isinstance(key, str) and key.startswith("model.")) or not isinstance(meta, TensorStorageMetadata):
            continue
        numel = 1
        for s in meta.size:
            numel *= int(s)
        declared += numel * torch.empty((), dtype=meta.properties.dtype).element_size()
    total = sum(sizes.values())
    if declared > archive_budget(total):
        raise BadInputError(f"refused: the DCP metadata declares {declared} bytes of model tensors over "
                            f"{total} bytes of data files", path=d, fix="the directory is damaged or foreign; " + _RERECORD)


def _from_dcp(path, d: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    md = read_dcp_metadata(d)

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            return md  # already read through the allow-list

    class _Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item, value):  # the stock planner loads these with weights_only=False
            obj = torch.load(value, weights_only=True)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    sd: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group": the one-process load is on purpose
            _load_state_dict(sd, storage_reader=_Reader(str(d)), planner=_Planner(keys={"model"}), no_dist=True)
    except BadInputError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt data file fails inside torch in many ways
        raise BadInputError(f"the DCP checkpoint cannot be read ({type(e).__name__}: {str(e).strip()[:160]})",
                            path=d, fix="the directory is damaged, truncated or foreign; " + _RERECORD) from e
    return _validated(sd.get("model"), d)


def _validated(state: Any, where) -> dict[str, torch.Tensor]:
    if not isinstance(state, dict) or not state:
        raise BadInputError("the consolidated model state is empty or not a dict", path=where, fix=_RERECORD)
    check_nesting(state, path=where, what="the model state")
    for name, t in state.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise BadInputError(f"model state entry {name!r} is not a named tensor"[:200], path=where, fix=_RERECORD)
        check_dense(t, path=where, where=f"model[{name!r}]")
    return state


# -- local shards of every rank -----------------------------------------------------------------
def _from_local_shards(path, snap: Mapping) -> dict[str, torch.Tensor]:
    """Join each rank's ``local_state`` by the ``layout`` offsets (FSDP2 shards dim 0)."""
    from .snapshot import load_snapshot

    world = snap["fsdp"].get("world_size") or snap.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= 1 << 16:
        raise BadInputError(f"snapshot fsdp.world_size {world!r} is not a rank count"[:200], path=path,
                            fix="re-record the run")
    parts = []
    for rank in range(world):
        try:
            f = Path(path) if rank == snap.get("rank") else sibling_snapshot(path, rank)
        except BadInputError as e:
            raise BadInputError(f"this snapshot holds only rank {snap.get('rank')}'s shards, and rank {rank} wrote "
                                f"no snapshot of step {snap.get('step')} (no trigger fired on that rank, or its "
                                "max_snapshots was spent): the whole model needs every rank's shards",
                                path=path, fix="copy every rank's snapshot of this step beside it, or " + _RERECORD
                                ) from e
        other = snap if f == Path(path) else load_snapshot(f)
        fsdp = other.get("fsdp")
        if not isinstance(fsdp, Mapping) or not isinstance(fsdp.get("local_state"), dict):
            raise BadInputError("this rank's snapshot holds no local shards", path=f, fix=_RERECORD)
        parts.append((f, fsdp["local_state"], fsdp.get("layout") or {}))
    first_state, layout0 = parts[0][1], parts[0][2]
    state: dict[str, torch.Tensor] = {}
    for name, t0 in first_state.items():
        if name not in layout0:  # a buffer or an unsharded parameter: whole on every rank
            state[name] = t0
            continue
        state[name] = _join(name, parts)
    return _validated(state, path)


def _join(name: str, parts: list) -> torch.Tensor:
    f0, _, layout0 = parts[0]
    shape = layout0[name].get("shape") if isinstance(layout0[name], Mapping) else None
    if not isinstance(shape, list) or not shape or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise BadInputError(f"layout of {name!r} has no shape"[:200], path=f0, fix="re-record the run")
    shards = []
    for f, local, layout in parts:
        t, where = local.get(name), layout.get(name) if isinstance(layout, Mapping) else None
        off = where.get("offset") if isinstance(where, Mapping) else None
        if not isinstance(t, torch.Tensor) or not isinstance(off, list) or len(off) != len(shape) \
                or t.dim() != len(shape) or not all(isinstance(o, int) and 0 <= o and o + n <= s
                                                    for o, n, s in zip(off, t.shape, shape)):
            raise BadInputError(f"the shard of {name!r} has no offset inside {shape}"[:200], path=f,
                                fix="record with a torch whose FSDP2 reports shard offsets, or " + _RERECORD)
        shards.append((t, off))
    # FSDP2 shards dim 0: the shards must tile it in order, each whole along the other dims
    end = 0
    for t, off in sorted(shards, key=lambda s: (s[1][0], s[0].shape[0])):
        if t.numel() == 0:
            continue
        if off[0] != end or any(off[1:]) or list(t.shape[1:]) != shape[1:]:
            raise BadInputError(f"the ranks' shards of {name!r} do not tile its shape {shape}"[:200], path=f0,
                                fix=_RERECORD)
        end += t.shape[0]
    if end != shape[0]:
        raise BadInputError(f"the ranks' shards of {name!r} do not cover its shape {shape}"[:200], path=f0,
                            fix=_RERECORD)
    full = torch.empty(shape, dtype=shards[0][0].dtype)  # NB: bounded: exactly the shards' own bytes
    for t, off in shards:
        full[tuple(slice(o, o + n) for o, n in zip(off, t.shape))] = t
    return full

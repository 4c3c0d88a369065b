"""A checkpoint plus a saved batch, read into the ``Snapshot`` value replay consumes: runs without a recorder.

``analyzer replay CHECKPOINT --batch FILE`` (and ``autopsy``) call ``load_checkpoint_snapshot``:
the weights, the batch and the flags fill the keys a recorder snapshot would carry, and what no
file can tell (the loss scale, the RNG state, the buffers as they were before the step) gets a
default that the result names in its notes. Every file goes through the safe readers
(``torchfile.torch_load_safe``: weights_only; ``safetensors.load_safetensors``).

Checkpoints read:

- a plain ``state_dict`` (``.pt``/``.bin`` or ``.safetensors``), or a dict holding one under
  ``model``, ``state_dict`` or ``model_state_dict`` (a ``scaler`` GradScaler state beside it
  gives the loss scale): ``--factory`` and ``--loss-fn`` say which model and loss;
- an HF ``save_pretrained`` / Trainer ``checkpoint-N/`` directory (``config.json`` plus
  ``model.safetensors`` or ``pytorch_model.bin``, sharded or not): the class is
  ``config.json``'s ``architectures`` entry in transformers' module for its ``model_type``
  (``recorders.integrations.hf:build_pretrained``), the loss ``model(**batch).loss``;
  ``trainer_state.json`` gives the step and the report;
- a Lightning ``.ckpt``: its ``state_dict`` and ``hyper_parameters``, rebuilt by
  ``recorders.integrations.lightning:build_module``. The class is the ``_class_path`` LightningCLI
  stores, else the one LightningModule under ``--path`` or the current directory whose
  ``__init__`` takes those hyperparameters (``_modclass``); the import rule applies either way.

Example:
    >>> snap = load_checkpoint_snapshot("out/checkpoint-40", "bad_batch.pt")  # doctest: +SKIP
    >>> snap.factory, snap.amp_dtype, snap.scale                             # doctest: +SKIP
    ('recorders.integrations.hf:build_pretrained', 'float16', 65536.0)
    >>> snap.notes[0]                                                         # doctest: +SKIP
    'no recorder snapshot: the weights of an HF checkpoint directory out/checkpoint-40 and the batch bad_batch.pt'
"""
from __future__ import annotations

import inspect
import json
import math
import os
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from recorders import schema

from ..errors import BadInputError, FactoryError
from ._ckpt import (_MAX_JSON, HF_BUILDER, HF_LOSS, PL_BUILDER, PL_LOSS, STATE_KEYS, _int_of, _scaler_scale,  # noqa: F401
                    clean_state, read_json, state_dict_of)
from ._batchfile import micro_batch_file
from ._dense import check_dense
from .rngfile import load_rng_file, split_batch_rng
from .safetensors import load_safetensors, looks_like_safetensors
from .snapshot import Snapshot
from .torchfile import ZIP_ERRORS, is_zip, torch_load_safe

__all__ = ["CHECKPOINT_FORMAT", "CheckpointSnapshot", "checkpoint_instead", "load_checkpoint_snapshot"]

CHECKPOINT_FORMAT = "amp-autopsy.checkpoint"  # Snapshot.format of a value built here, never written to disk
REASON = "checkpoint"
SEED = 0  # dropout and every other random op replay from torch.manual_seed(SEED)
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_AMP = {"fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}
RECIPE = ("save the failing step's batch with torch.save(batch, 'batch.pt') in the loop (with its RNG state: "
          "torch.save({'batch': batch, 'rng': rng}, 'batch.pt')), or with "
          "callbacks=[recorders.integrations.hf.save_batch_on_nan('batch.pt')] under HF Trainer")


@dataclass(frozen=True, eq=False)
class CheckpointSnapshot(Snapshot):
    """A ``Snapshot`` made from a checkpoint and a batch; replay and autopsy take it as they take a file's.

    Attributes (beyond ``Snapshot``'s):
        kind: ``state_dict``, ``hf`` or ``lightning``.
        batch_path: the ``--batch`` file.
        notes: what stood in for what a recorder snapshot would carry (the defaults), one line each.
        logs: the checkpoint's own training log (an HF ``trainer_state.json``), for the report; None.
    """

    kind: str = "state_dict"
    batch_path: str = ""
    notes: tuple[str, ...] = ()
    logs: str | None = None
    source: dict = field(default_factory=dict)  # the JSON form: the result's ``checkpoint`` field


def load_checkpoint_snapshot(path: str | os.PathLike, batch: str | os.PathLike, *, factory: str | None = None,
                             loss_fn: str | None = None, amp: str | None = None, scale: float | None = None,
                             device: str = "auto", paths: tuple[str, ...] = (),
                             accumulate: str = "auto", rng: str | os.PathLike | None = None) -> CheckpointSnapshot:
    """Read a checkpoint and a ``torch.save``'d batch into a ``CheckpointSnapshot``.

    Args:
        path: a state_dict file, an HF checkpoint directory or a Lightning ``.ckpt``.
        batch: the failing step's batch: a tensor, a dict or list of them, or a list of micro-batches.
        factory, loss_fn: ``--factory`` / ``--loss-fn``; needed for a plain state_dict.
        amp: ``fp16`` (default) or ``bf16``: the precision the run trained in.
        scale: the loss scale; default 1 for BF16, the checkpoint's GradScaler scale or
            GradScaler's default ``init_scale`` for FP16.
        device: where the replay will run (``auto``, ``cpu``, ``cuda``): the random state is made for it.
        paths: ``--path`` roots, where a Lightning module class is looked for.
        accumulate: ``--accumulate``: how a list of micro-batches is replayed (``_batchfile.ACCUMULATE``).
        rng: ``--rng``: a file holding the failing step's RNG state (``rngfile``); else the batch file's ``rng``
            entry, if it has one; else a fixed seed.

    Raises:
        BadInputError: an unreadable, pickled-class, foreign or incomplete file; FactoryError: no
            model or loss can be named.
    """
    path = os.fspath(path)
    amp_dtype = _AMP.get(str(amp or "fp16").lower())
    if amp_dtype is None:
        raise BadInputError(f"unknown --amp {amp!r}", fix="pass --amp fp16 or --amp bf16")
    ck = _read_checkpoint(Path(path), factory=factory, paths=paths)
    refs = {"factory": factory or ck["factory"], "loss_fn": loss_fn or ck["loss_fn"]}
    for role, option, what in (("factory", "--factory", "pkg.mod:build (it returns the nn.Module)"),
                               ("loss_fn", "--loss-fn", "pkg.mod:loss, where loss = loss(model, batch)")):
        if not refs[role]:
            raise FactoryError(f"{ck['what']} does not say which {'model' if role == 'factory' else 'loss'} "
                               "it belongs to", path=path, fix=f"pass {option} {what}")
    kwargs = ck["factory_kwargs"] if not factory or ck["kind"] == "lightning" else {}
    optimizer = ck.get("optimizer")
    if optimizer is None and ck.get("optimizer_sd") is not None and _nonfinite(ck["state"]):
        optimizer, note = _model_optimizer(path, ck["optimizer_sd"], refs["factory"], kwargs,
                                           explicit=factory is not None, paths=paths)
        ck["notes"].append(note)
    data, batch_notes, micro, batch_rng = read_batch_and_rng(batch, hf=ck["kind"] == "hf" and not loss_fn,
                                                             accumulate=accumulate)
    low_scale, scale_note = _scale(amp_dtype, scale, ck.get("scaler_scale"))
    dev = "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"
    state_rng = load_rng_file(rng) if rng is not None else batch_rng
    rng_from = (f"{os.fspath(rng)} (--rng)" if rng is not None else
                f"the batch file's 'rng' entry" if batch_rng is not None else None)
    notes = [f"no recorder snapshot: the weights of {ck['what']} {path} and the batch {os.fspath(batch)}",
             f"AMP dtype {amp_dtype}" + (" (--amp)" if amp else " (the --amp default; pass --amp bf16 for a BF16 run)"),
             scale_note, *ck["notes"], *batch_notes,
             *([f"RNG state: {rng_from}, so random ops draw what the failing step drew"] if rng_from else []),
             _missing_note(scale is None and ck.get("scaler_scale") is None, rng_from is None)]
    raw = {
        "format": CHECKPOINT_FORMAT, "format_version": schema.FORMAT_VERSION, "torch_version": torch.__version__,
        "amp_autopsy_version": None, "created": time.time(), "host": None, "rank": 0, "world_size": 1,
        "step": ck.get("step"), "reason": REASON, "device_type": dev, "amp_dtype": amp_dtype, "scale": low_scale,
        "scaler_state": None, "factory": refs["factory"], "factory_kwargs": kwargs, "loss_fn": refs["loss_fn"],
        "train_mode": True,
        "model_state": ck["state"], "batch": data, "rng": state_rng if state_rng is not None else _fixed_rng(dev),
        "loss": None, "loss_dtype": None,
        "grad_norm": None, "cwd": None, "sdpa": None, "fsdp": None, "optimizer": optimizer, "update": None,
        "exception": None, "compile": None, "micro_batches": micro,  # a list of micro-batches: accumulation
        "spike": None,  # (format 7) a checkpoint is no spike snapshot
        "rewind": None,  # (format 8) nor holds a rewind window
        "fp8_recipe": None, "fp8": None,  # (format 8) a checkpoint records no FP8 recipe nor casts
        "ddp": None,  # (format 9) nor DDP's all-reduce
    }
    source = {"checkpoint": path, "kind": ck["kind"], "batch": os.fspath(batch), "amp_dtype": amp_dtype,
              "scale": 1.0 if low_scale is None else low_scale, "seed": None if rng_from else SEED,
              "rng": os.fspath(rng) if rng is not None else os.fspath(batch) if batch_rng is not None else None,
              "logs": ck.get("logs"), "notes": notes}
    return CheckpointSnapshot(path=path, **{k: raw[k] for k in schema.SNAPSHOT_KEYS}, _raw=MappingProxyType(raw),
                              kind=ck["kind"], batch_path=os.fspath(batch), notes=tuple(notes), logs=ck.get("logs"),
                              source=source)


def checkpoint_instead(path: str | os.PathLike) -> BadInputError | None:
    """For ``replay PATH`` without ``--batch``: the error to give when PATH is a checkpoint, not a snapshot.

    Cheap: a directory is looked at (an HF checkpoint has ``config.json`` and weights), a
    ``.safetensors`` or ``.ckpt`` file by its name, a torch zip by its pickle record alone (a
    snapshot's holds ``amp-autopsy.snapshot``). None when PATH may be a snapshot: the snapshot
    reader then has its say.
    """
    p = Path(path)
    fix = f"to replay a checkpoint, pass --batch FILE: {RECIPE}"
    if p.is_dir():
        if (p / "config.json").is_file() and any((p / w).is_file() for w in _HF_WEIGHTS):
            return BadInputError("not an amp-autopsy snapshot: an HF checkpoint directory", path=p, fix=fix)
        return None
    if not p.is_file():
        return None
    if p.suffix == ".ckpt":
        return BadInputError("not an amp-autopsy snapshot: a Lightning checkpoint", path=p, fix=fix)
    if p.suffix == ".safetensors" or looks_like_safetensors(p):
        return BadInputError("not an amp-autopsy snapshot: a safetensors file", path=p,
                             fix=fix + "; a plain state_dict also needs --factory and --loss-fn; to check its "
                                 f"values for NaN/Inf: analyzer inspect {p}")
    try:
        with zipfile.ZipFile(p) as zf:
            pkl = next((i for i in zf.infolist() if i.filename.endswith("/data.pkl")), None)
            if pkl is None or pkl.file_size > _MAX_JSON:
                return None
            head = zf.read(pkl)
    except (*ZIP_ERRORS, RuntimeError):
        return None
    if schema.SNAPSHOT_FORMAT.encode() in head:
        return None
    return BadInputError("not an amp-autopsy snapshot (no 'format': 'amp-autopsy.snapshot' key): a checkpoint?", path=p,
                         fix=fix + "; a plain state_dict also needs --factory and --loss-fn; "
                                   "'analyzer inspect' checks a checkpoint's tensors")


def _missing_note(no_scale: bool, no_rng: bool) -> str:
    """What no file told, and what stood in for it (only what is missing: a scale from the checkpoint is not)."""
    missing = [w for w, gone in (("loss scale", no_scale), ("RNG state", no_rng), ("pre-step buffers", True)) if gone]
    listed = missing[0] if len(missing) == 1 else ", ".join(missing[:-1]) + " or " + missing[-1]
    note = f"no recorded {listed} were available: buffers are the checkpoint's"  # buffers: always missing, plural
    if no_rng:
        note += (f", and dropout and every other random op run with a fixed seed ({SEED}), not the failing step's "
                 "masks or draws (pass --rng FILE, or save {'batch': batch, 'rng': rng} as the batch file)")
    return note


# -- the batch -----------------------------------------------------------------------------------
def read_batch_and_rng(path: str | os.PathLike, *, hf: bool = False,
                       accumulate: str = "auto") -> tuple[Any, list[str], dict | None, dict | None]:
    """``read_batch``, and the RNG state saved beside the batch (``{"batch": B, "rng": R}``), else None."""
    obj = torch_load_safe(path)
    batch, rng = split_batch_rng(obj, path)
    return (*_read_batch(batch, path, hf=hf, accumulate=accumulate), rng)


def read_batch(path: str | os.PathLike, *, hf: bool = False,
               accumulate: str = "auto") -> tuple[Any, list[str], dict | None]:
    """The batch in ``path`` (weights_only), notes, and the ``micro_batches`` entry of a list of micro-batches
    (``_batchfile``: replayed as accumulation, or joined with ``accumulate="join"``); an HF tensor made a dict."""
    return _read_batch(torch_load_safe(path), path, hf=hf, accumulate=accumulate)


def _read_batch(obj: Any, path: str | os.PathLike, *, hf: bool, accumulate: str) -> tuple[Any, list[str], dict | None]:
    fix = f"the batch the failing step's loss was computed on: {RECIPE}"
    obj, notes, micro = micro_batch_file(obj, path, accumulate, fix=fix)
    leaves = [(w, t) for w, t in _leaves(obj, "batch")]
    if not any(isinstance(t, torch.Tensor) for _, t in leaves):
        raise BadInputError(f"holds no tensor (a {type(obj).__name__})", path=path, fix=fix)
    for where, t in leaves:
        if isinstance(t, torch.Tensor):
            check_dense(t, path=path, where=where)
    if hf and isinstance(obj, torch.Tensor):
        obj = {"input_ids": obj, "labels": obj}
        notes.append("the batch is one tensor: replayed as model(input_ids=batch, labels=batch).loss")
    elif hf and micro is not None and not all(isinstance(m, dict) for m in obj):
        raise BadInputError(f"an HF model's micro-batches are dicts of its inputs, got {type(obj[0]).__name__}s",
                            path=path, fix=fix)
    elif hf and micro is None and not isinstance(obj, dict):
        raise BadInputError(f"an HF model's batch is the dict of its inputs, got a {type(obj).__name__}",
                            path=path, fix=fix)
    return obj, notes, micro


def _leaves(obj: Any, where: str):
    stack = [(obj, where)]
    while stack:
        cur, w = stack.pop()
        if isinstance(cur, dict):
            stack.extend((v, f"{w}[{k!r}]") for k, v in cur.items())
        elif isinstance(cur, (list, tuple)):
            stack.extend((v, f"{w}[{i}]") for i, v in enumerate(cur))
        else:
            yield w, cur


# -- defaults ------------------------------------------------------------------------------------
def _scale(amp: str, scale: float | None, recorded: float | None) -> tuple[float | None, str]:
    if scale is not None:
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise BadInputError(f"--scale {scale!r} is not a positive finite number", fix="pass --scale S, e.g. 1024")
        return float(scale), f"loss scale {scale:g} (--scale)"
    if amp == "bfloat16":
        return None, "loss scale 1 (BF16 trains without a GradScaler; pass --scale S otherwise)"
    if recorded is not None:
        return recorded, f"loss scale {recorded:g}: the GradScaler state saved in the checkpoint"
    init = float(inspect.signature(torch.amp.GradScaler).parameters["init_scale"].default)
    return init, (f"loss scale {init:g}: GradScaler's default init_scale, as no scale was recorded "
                  "(pass --scale S with the run's scale, e.g. from its logs)")


def _fixed_rng(device: str) -> dict:
    """Generator states of ``torch.manual_seed(SEED)``: CPU, and each CUDA device for a CUDA replay."""
    cpu = torch.Generator().manual_seed(SEED).get_state()
    cuda = None
    if device == "cuda":
        n = torch.cuda.device_count()
        with torch.random.fork_rng(devices=list(range(n))):
            torch.cuda.manual_seed_all(SEED)
            cuda = torch.cuda.get_rng_state_all()
    return {"cpu": cpu, "cuda": cuda}


# -- the checkpoint ------------------------------------------------------------------------------
def _read_checkpoint(p: Path, *, factory: str | None, paths: tuple[str, ...]) -> dict:
    if p.is_dir():
        from ._hfdir import read_hf_dir

        return read_hf_dir(p, build=factory is None)
    if not p.exists():
        raise BadInputError("no such file or directory", path=p, fix="check the path")
    if p.suffix == ".safetensors" or looks_like_safetensors(p):
        tensors, _ = load_safetensors(p)
        return _plain(p, tensors, "a safetensors state_dict", [])
    obj = torch_load_safe(p, mmap=is_zip(p))
    if isinstance(obj, dict) and obj.get("format") == schema.SNAPSHOT_FORMAT:
        raise BadInputError("is a recorder snapshot: it holds its own batch", path=p,
                            fix=f"replay it without --batch: analyzer replay {p}")
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict) and (
            "hyper_parameters" in obj or "pytorch-lightning_version" in obj):
        from ._modclass import lightning_checkpoint

        return lightning_checkpoint(p, obj, paths=paths, explicit=factory is not None)
    state, where = state_dict_of(obj, p)
    notes = [f"weights: the state_dict under {where!r}"] if where else []
    out = _plain(p, state, "plain state_dict" if not where else "training-checkpoint dict", notes)
    out["step"] = _int_of(obj, ("global_step", "step", "iter_num", "iteration")) if where else None
    out["scaler_scale"] = _scaler_scale(obj) if where else None
    out["optimizer_sd"] = next((obj[k] for k in ("optimizer", "optimizer_state_dict", "optim")
                                if where and isinstance(obj.get(k), dict)), None)
    return out


def _nonfinite(state: dict) -> bool:
    return any(t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()) for t in state.values())


def _model_optimizer(path: str, sd: dict, ref: str, kwargs: dict, *, explicit: bool, paths) -> tuple[dict | None, str]:
    """The optimizer state over the model's ``named_parameters()`` (built on the meta device: no memory)."""
    from ._optim import optimizer_entry
    from .refs import resolve_ref

    try:
        build = resolve_ref(ref, what="factory", option="--factory", roots=tuple(os.path.abspath(r) for r in paths),
                            explicit=explicit)
        with torch.device("meta"):
            model = build(**kwargs)
        order = [(n, t) for n, t in model.named_parameters() if t.requires_grad]
    except Exception as e:  # noqa: BLE001 - the replay reports a factory that fails; here it only costs the forensics
        return None, f"the optimizer state is not used: the model could not be built to name its parameters " \
                     f"({type(e).__name__}: {' '.join(str(e).split())[:120]})"
    return optimizer_entry(path, "the checkpoint's optimizer state", sd, order, None,
                           "the model's named_parameters() order", adam="torch.optim.adam.Adam")


def _plain(p: Path, state: dict, what: str, notes: list[str]) -> dict:
    state, more = clean_state(state, p)
    return {"kind": "state_dict", "what": f"a {what}", "state": state, "factory": None, "loss_fn": None,
            "factory_kwargs": {}, "notes": notes + more, "step": None}

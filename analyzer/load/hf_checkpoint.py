"""An HF Trainer checkpoint directory (``checkpoint-N/``) opened as one ``Checkpoint`` for inspect.

Read: the weights (``model.safetensors`` with our safetensors reader, or ``pytorch_model.bin``;
sharded ones through their ``*.index.json``), ``optimizer.pt`` and ``scaler.pt`` (weights_only).
Reported briefly: ``scheduler.pt`` and ``trainer_state.json`` (its global_step is the checkpoint's
step). Skipped with a note: ``rng_state.pth`` (RNG state only: numpy arrays, which weights_only
loading refuses) and ``training_args.bin`` (a pickled ``TrainingArguments`` object).

``optimizer.pt`` holds integer parameter ids. ``Trainer.create_optimizer`` builds two parameter
groups, the parameters weight decay applies to and the rest (biases, norms), each in the model's
``named_parameters()`` order. With transformers installed, the model class ``config.json`` names
(``architectures``, a class of transformers itself: nothing from the directory runs) is built on
the meta device, and the installed Trainer's own ``get_decay_parameter_names`` splits its
parameters: the ids then map to names exactly when every group size and state shape agrees
(mapping ``"hf_trainer"``). Otherwise the ids are mapped by order, as a guess, with a note.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInputError
from ._ckvalues import number, read_scaler
from ._optimizer_state import is_optimizer_state, read_optimizer
from .checkpoint import Checkpoint, _is_scaler_state, _read, _Walker
from .logs import HF_TRAINER_STATE
from .torchfile import torch_load_safe

__all__ = ["is_hf_checkpoint_dir", "load_hf_checkpoint"]

_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_MAX_JSON = 64 << 20  # config.json, trainer_state.json and weight indexes are far smaller
_FIX = "pass a checkpoint-N/ directory the HF Trainer wrote, or one of its files"


def is_hf_checkpoint_dir(path: Path) -> bool:
    """A directory holding HF weights or an HF optimizer.pt."""
    return path.is_dir() and any((path / n).is_file() for n in (*_WEIGHTS, *_INDEXES, "optimizer.pt"))


def _json(path: Path) -> Any:
    try:
        if path.stat().st_size > _MAX_JSON:
            raise BadInputError(f"{path.name} is larger than {_MAX_JSON >> 20} MiB", path=path, fix=_FIX)
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise BadInputError(f"unreadable {path.name} ({type(e).__name__}: {str(e)[:120]})", path=path, fix=_FIX) from e


def _weight_files(d: Path) -> list[Path]:
    for name in _WEIGHTS:
        if (d / name).is_file():
            return [d / name]
    for name in _INDEXES:
        if (d / name).is_file():
            index = _json(d / name)
            wmap = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
                raise BadInputError(f"{name} has no weight_map of file names", path=d / name, fix=_FIX)
            files = sorted(set(wmap.values()))
            bad = [f for f in files if Path(f).name != f or not (d / f).is_file()]
            if bad:
                raise BadInputError(f"{name} names shard {bad[0][:80]!r}, which is not a file beside it",
                                    path=d / name, fix=_FIX)
            return [d / f for f in files]
    return []


def _weights(files: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    fmt = "safetensors"
    for f in files:
        obj, fmt, _, _ = _read(f)  # read checked: no deferred CRC, no stream here
        if fmt == "safetensors":
            part, meta = obj
            metadata.update(meta)
        else:
            part = obj.get("state_dict", obj) if isinstance(obj, dict) else None
            if not isinstance(part, dict):
                raise BadInputError("not a state_dict", path=f, fix=_FIX)
        tensors.update({k: v for k, v in part.items() if isinstance(k, str) and isinstance(v, torch.Tensor)})
    return tensors, metadata, fmt


def _hf_groups(d: Path) -> tuple[list[list[str]] | None, str]:
    """The Trainer's parameter groups (names in model order), or None and why not."""
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        return None, "no config.json to rebuild the model's parameter order from"
    cfg = _json(cfg_path)
    arch = cfg.get("architectures") if isinstance(cfg, dict) else None
    if not (isinstance(arch, list) and len(arch) == 1 and isinstance(arch[0], str) and arch[0].isidentifier()):
        return None, "config.json names no single model class (architectures)"
    try:
        import transformers
        from transformers import PreTrainedModel, Trainer
    except ImportError:
        return None, "transformers is not installed (pip install 'amp-autopsy[hf]' to map HF's groups by name)"
    cls = getattr(transformers, arch[0], None)
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        return None, f"config.json's model class {arch[0][:60]!r} is not a transformers model class"
    try:
        config = cls.config_class.from_dict({k: v for k, v in cfg.items() if k != "auto_map"})
        with torch.device("meta"):
            model = cls(config)
        decay = set(Trainer.get_decay_parameter_names(None, model))
    except Exception as e:  # noqa: BLE001 - a config this transformers cannot build: fall back to order
        return None, f"transformers could not build {arch[0]} from config.json ({type(e).__name__})"
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return [[n for n in names if n in decay], [n for n in names if n not in decay]], arch[0]


def _with_names(opt: dict, groups: list[list[str]], weights: dict[str, torch.Tensor]) -> tuple[dict | None, str]:
    """`opt` with each group's ``param_names`` from HF's groups, when every size and shape agrees."""
    saved = [g for g in opt["param_groups"] if isinstance(g, dict)]
    sizes = [len(g.get("params", ())) for g in saved]
    want = [len(g) for g in groups]
    if sizes != want:
        return None, f"its param groups hold {sizes} parameters, HF's groups for this model {want}"
    state = opt["state"]
    for g, names in zip(saved, groups):
        for pid, name in zip(g["params"], names):
            w = weights.get(name)
            for v in (state.get(pid) or {}).values() if isinstance(state.get(pid), dict) else ():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and (w is None or v.shape != w.shape):
                    return None, f"the state of id {pid} does not have the shape of {name}"
    return {**opt, "param_groups": [{**g, "param_names": n} for g, n in zip(saved, groups)]}, ""


def _scheduler_note(path: Path) -> str:
    try:
        sd = torch_load_safe(path)
    except BadInputError as e:
        return f"scheduler.pt not read ({e})"[:240]
    if not isinstance(sd, dict):
        return "scheduler.pt: not a scheduler state_dict"
    step, lr = number(sd.get("last_epoch"), int), sd.get("_last_lr")
    lrs = [x for x in (lr if isinstance(lr, list) else []) if number(x, float) is not None]
    shown = ", ".join(f"{number(x, float):g}" for x in lrs[:4])
    return (f"scheduler.pt: LR scheduler state" + (f" at step {step}" if step is not None else "")
            + (f", last lr {shown}" if shown else ""))


def _trainer_state(path: Path, ckpt: Checkpoint) -> str:
    state = _json(path)
    if not isinstance(state, dict):
        return "trainer_state.json: not an HF trainer state"
    gs = number(state.get("global_step"), int)
    if gs is not None:
        ckpt.step, ckpt.step_key = gs, "trainer_state.json global_step"
    logs = [e for e in state.get("log_history") or () if isinstance(e, dict) and "loss" in e]
    bad = next((e.get("step") for e in logs
                if not math.isfinite(number(e.get("grad_norm"), float) or 0.0)
                or not math.isfinite(number(e.get("loss"), float) or 0.0)), None)
    text = f"trainer_state.json: global_step {gs}, {len(logs)} logged training step(s)"
    if bad is not None:
        text += f", the first with a NaN/Inf loss or grad_norm at step {bad} (analyzer report reads the log)"
    return text


def load_hf_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open an HF Trainer ``checkpoint-N/`` directory: weights, optimizer state by name, notes."""
    d = Path(path)
    files = _weight_files(d)
    opt_path, scaler_path = d / "optimizer.pt", d / "scaler.pt"
    sizes = [f.stat().st_size for f in [*files, opt_path, scaler_path] if f.is_file()]
    ckpt = Checkpoint(path=os.fspath(d), format="hf_checkpoint", layout="hf_checkpoint", nbytes=sum(sizes))
    walker = _Walker(ckpt)
    weights, ckpt.metadata, fmt = _weights(files)
    if weights:
        ckpt.format = fmt
        walker.walk(weights, "")
    else:
        ckpt.notes.append("no model weights (model.safetensors / pytorch_model.bin) in this directory")
    if (d / HF_TRAINER_STATE).is_file():
        ckpt.notes.append(_trainer_state(d / HF_TRAINER_STATE, ckpt))
    mapping_note = ""
    if opt_path.is_file():
        opt = torch_load_safe(opt_path, mmap=True)
        if not is_optimizer_state(opt):
            raise BadInputError("not an optimizer state_dict (state and param_groups)", path=opt_path, fix=_FIX)
        groups, why = _hf_groups(d)
        named, mismatch = _with_names(opt, groups, weights) if groups is not None else (None, why)
        walker.optims.append(("optimizer.pt", named or opt))
        mapping_note = (f"exact: Trainer.create_optimizer's parameter groups for {why} (weight decay, then "
                        "none), each in named_parameters() order" if named else
                        f"HF's parameter groups not used: {mismatch}")
    if scaler_path.is_file():
        sc = torch_load_safe(scaler_path)
        if _is_scaler_state(sc):
            read_scaler(sc, "scaler.pt", ckpt)
    if (d / "scheduler.pt").is_file():
        ckpt.notes.append(_scheduler_note(d / "scheduler.pt"))
    for name, what in (("rng_state.pth", "RNG state only (numpy arrays, which weights_only loading refuses)"),
                       ("training_args.bin", "a pickled TrainingArguments object (loading it would run code)")):
        if (d / name).is_file():
            ckpt.notes.append(f"{name} skipped: {what}")
    ckpt.optimizers = [read_optimizer(walker, p, o) for p, o in walker.optims]
    if opt_path.is_file():
        o = ckpt.optimizers[0]
        if o.mapping == "param_names":
            ckpt.optimizers[0] = dataclasses.replace(o, mapping="hf_trainer", note=mapping_note)
        else:
            ckpt.optimizers[0] = dataclasses.replace(o, note=f"{o.note}; {mapping_note}")
    if not ckpt.entries:
        raise BadInputError("no floating-point tensors in this directory", path=d, fix=_FIX)
    return ckpt

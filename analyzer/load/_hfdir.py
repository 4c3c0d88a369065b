"""An HF ``save_pretrained`` / Trainer ``checkpoint-N/`` directory -> the weights, the builder's kwargs, the step.

The model class is ``config.json``'s ``architectures`` entry, looked up in transformers' own module
for the config's ``model_type`` (``transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel``); the
HF builder (``recorders.integrations.hf:build_pretrained``) imports it under the import rule.
A config with ``auto_map`` (code shipped with the checkpoint, ``trust_remote_code``) is refused:
the checkpoint's own code never runs unless the user names it with ``--factory``.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import BadInputError, FactoryError
from ._ckpt import HF_BUILDER, HF_LOSS, _scaler_scale, clean_state, read_json, state_dict_of
from ._optim import optimizer_entry
from .logs import HF_TRAINER_STATE
from .safetensors import load_safetensors
from .torchfile import torch_load_safe

__all__ = ["read_hf_dir"]

_FIX = "pass the directory save_pretrained or the HF Trainer wrote (config.json and model.safetensors)"


def read_hf_dir(p: Path, *, build: bool = True) -> dict:
    """The checkpoint directory `p` read for ``adhoc``; `build`: complete tied weights from the class."""
    if not (p / "config.json").is_file():
        raise BadInputError("is a directory without config.json: not an HF checkpoint directory", path=p,
                            fix=_FIX + "; a run directory of the Recorder holds snapshots/ to replay")
    config = read_json(p / "config.json")
    if not isinstance(config, dict):
        raise BadInputError("config.json is not a JSON object", path=p / "config.json", fix=_FIX)
    state, notes = _weights(p)
    ref = model_class_ref(config, p) if build else None
    optimizer = None
    if ref is not None:
        model = _meta_model(ref, config, p)
        state, tied = _tie(model, state)
        if tied:
            notes.append(f"tied weights filled in from the ones they share: {', '.join(tied[:3])}"
                         + (f" and {len(tied) - 3} more" if len(tied) > 3 else ""))
        if (p / "optimizer.pt").is_file():
            optimizer, note = trainer_optimizer(p / "optimizer.pt", model)
            notes.append(note)
    out = {"kind": "hf", "what": "an HF checkpoint directory", "state": state, "factory": HF_BUILDER,
           "loss_fn": HF_LOSS, "factory_kwargs": {"model_class": ref, "config": config}, "notes": notes,
           "step": None, "logs": None, "scaler_scale": None, "optimizer": optimizer}
    ts = p / HF_TRAINER_STATE
    if ts.is_file():
        st = read_json(ts)
        gs = st.get("global_step") if isinstance(st, dict) else None
        if isinstance(gs, int) and not isinstance(gs, bool) and 0 <= gs < 2**63:
            out["step"] = gs  # optimizer steps done: the 0-based number of the step after the checkpoint
        out["logs"] = str(ts)
    if (p / "scaler.pt").is_file():
        out["scaler_scale"] = _scaler_scale({"scaler": torch_load_safe(p / "scaler.pt")})
    return out


def model_class_ref(config: dict, p: Path) -> str:
    """``config.json``'s architecture as ``transformers.models.M.modeling_M:Class``."""
    fix = "pass --factory pkg.mod:build (returning the model) and --loss-fn, or re-save it with save_pretrained"
    if config.get("auto_map"):
        raise FactoryError("config.json names its own code (auto_map, trust_remote_code): refusing to import "
                           "code that came with the checkpoint", path=p / "config.json",
                           fix="if you trust that code, name the builder yourself: " + fix)
    arch, mtype = config.get("architectures"), config.get("model_type")
    if not (isinstance(arch, list) and len(arch) == 1 and isinstance(arch[0], str) and arch[0].isidentifier()
            and isinstance(mtype, str) and mtype.replace("-", "_").isidentifier()):
        raise FactoryError("config.json names no single model class (architectures: one class name, and a "
                           f"model_type; got {str(arch)[:80]}, {str(mtype)[:40]})", path=p / "config.json", fix=fix)
    try:
        from transformers.models.auto.configuration_auto import model_type_to_module_name
    except ImportError as e:
        raise FactoryError("rebuilding an HF model needs transformers", path=p,
                           fix="pip install 'amp-autopsy[hf]'") from e
    module = model_type_to_module_name(mtype)
    return f"transformers.models.{module}.modeling_{module}:{arch[0]}"


def _weights(p: Path) -> tuple[dict, list[str]]:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (p / name).is_file():
            return _one(p / name), []
    for name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (p / name).is_file():
            index = read_json(p / name)
            wmap = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
                raise BadInputError("has no 'weight_map' of tensor name -> shard file", path=p / name, fix=_FIX)
            state: dict = {}
            for shard in sorted(set(wmap.values())):
                f = p / shard
                if Path(shard).name != shard or not f.is_file():  # a shard is a file beside the index, never a path
                    raise BadInputError(f"names a shard {shard!r} that is not a file in the directory",
                                        path=p / name, fix=_FIX)
                state.update(_one(f))
            return state, [f"weights joined from {len(set(wmap.values()))} shards"]
    raise BadInputError("holds config.json but no model.safetensors or pytorch_model.bin", path=p, fix=_FIX)


def _one(f: Path) -> dict:
    if f.suffix == ".safetensors":
        tensors, _ = load_safetensors(f)
    else:
        tensors, _ = state_dict_of(torch_load_safe(f), f)
    return clean_state(tensors, f)[0]


def _meta_model(ref: str, config: dict, p: Path) -> torch.nn.Module:
    """The model class built from config.json on the meta device (no memory): names, shapes, ties."""
    from .refs import resolve_ref

    build = resolve_ref(HF_BUILDER, what="factory", option="--factory")
    with torch.device("meta"):
        try:
            model = build(model_class=ref, config=config)
        except FactoryError:
            raise
        except Exception as e:  # noqa: BLE001 - a config the class rejects is the user's file, reported
            raise FactoryError(f"{ref} cannot be built from config.json: {type(e).__name__}: "
                               f"{' '.join(str(e).split())[:160]}", path=p / "config.json",
                               fix="pass --factory pkg.mod:build and --loss-fn") from e
    return model


def _tie(model: torch.nn.Module, state: dict) -> tuple[dict, list[str]]:
    """Entries save_pretrained leaves out because they share a tensor (``lm_head.weight`` tied to the
    embeddings), taken from the entry they share."""
    groups: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(t), []).append(name)
    state, tied = dict(state), []
    for names in groups.values():
        have = next((n for n in names if n in state), None)
        for n in names:
            if n not in state and have is not None:
                state[n] = state[have]
                tied.append(n)
    return state, tied


def trainer_optimizer(f: Path, model: torch.nn.Module) -> tuple[dict | None, str]:
    """A Trainer's ``optimizer.pt`` as the snapshot's ``optimizer`` entry (for the update forensics), and a note.

    The Trainer builds two parameter groups from ``named_parameters()``: the parameters that get
    weight decay, then the others (``Trainer.get_decay_parameter_names``); ``_optim`` maps the
    state's ids back to names in that order.
    """
    try:
        sd = torch_load_safe(f)
    except BadInputError as e:
        return None, f"{f.name} is not used (update forensics unavailable): {e.message}"
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, t) for n, t in model.named_parameters() if t.requires_grad]
    order = [(n, t) for n, t in named if n in decay] + [(n, t) for n, t in named if n not in decay]
    sizes = [sum(1 for n, _ in named if n in decay), sum(1 for n, _ in named if n not in decay)]
    return optimizer_entry(f, f.name, sd, order, sizes, "the Trainer's two parameter groups")

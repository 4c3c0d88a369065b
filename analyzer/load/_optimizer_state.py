"""An optimizer state_dict found in a checkpoint: its integer parameter ids mapped back to parameter names,
its per-parameter state listed as tensors, its param groups' hyperparameters.

The ids map exactly when the optimizer stored ``param_names`` (recent torch, snapshots), otherwise by
position onto a model state_dict of the same file when the counts and every state shape agree (a guess,
said so in the ``note``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import BadInputError
from ._ckvalues import number

__all__ = ["BUFFER", "FIX", "MODEL_KEYS", "OptimizerInfo", "read_optimizer", "named_state_dict", "is_optimizer_state",
           "number", "join"]

# Where training scripts usually keep the model, in order of preference for the optimizer mapping.
MODEL_KEYS = ("model", "model_state_dict", "state_dict", "model_state", "module", "net", "network")
BUFFER = re.compile(r"(^|\.)(running_mean|running_var|num_batches_tracked)$")
FIX = "pass a state_dict, a training-checkpoint dict, a .safetensors file or an amp-autopsy snapshot"


@dataclass(frozen=True)
class OptimizerInfo:
    """Where an optimizer state_dict sits and how its integer ids were mapped back to names."""

    path: str
    n_params: int
    mapping: str          # "param_names" (exact), "order" (a guess: i-th id = i-th parameter), "none"
    note: str
    stateless: tuple[str, ...] = ()  # params listed in param_groups that have no state (never stepped)
    # per param group: its numeric hyperparameters (lr, eps, betas, weight_decay, momentum, ...; only
    # numbers and pairs of numbers are kept) and "params", the mapped names of its parameters
    groups: tuple[dict[str, Any], ...] = ()


class Collector(Protocol):
    """What ``read_optimizer`` adds the state to: ``checkpoint._Walker``."""

    models: list[tuple[str, dict]]
    ckpt: Any  # .path: the file, for errors

    def add(self, name: str, role: str, t: torch.Tensor, **kw: Any) -> None: ...


def join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def is_optimizer_state(d: Any) -> bool:
    return isinstance(d, dict) and isinstance(d.get("state"), dict) and isinstance(d.get("param_groups"), list)


def _params(sd: dict) -> list[tuple[str, torch.Tensor]]:
    """The state_dict's parameters in order: floating, not a known buffer, tied duplicates dropped."""
    seen, out = set(), []
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor) or not v.is_floating_point() or BUFFER.search(k):
            continue
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride()))
        if v.numel() == 0 or key not in seen:  # empty tensors share data_ptr 0 without being tied
            seen.add(key)
            out.append((k, v))
    return out


def _order_mapping(ids: list, state: dict, models: list[tuple[str, dict]]) -> tuple[dict, str, str]:
    """Map optimizer ids to `model.param` names by position, when counts and every shape agree."""
    ranked = sorted(models, key=lambda m: MODEL_KEYS.index(m[0]) if m[0] in MODEL_KEYS else len(MODEL_KEYS))
    counts = []
    for mpath, sd in ranked:
        params = _params(sd)
        counts.append(f"{len(params)} in {mpath or 'the state_dict'!r}")
        if len(params) != len(ids):
            continue
        slots = [(i, st) for i, pid in enumerate(ids) if isinstance(st := state.get(pid), dict)]
        shapes_ok = all(v.dim() == 0 or v.shape == params[i][1].shape
                        for i, st in slots for v in st.values() if isinstance(v, torch.Tensor))
        if shapes_ok:
            names = {pid: join(mpath, params[i][0]) for i, pid in enumerate(ids)}
            return names, "order", (
                f"a guess: optimizer id i taken as the i-th parameter of {mpath or 'the state_dict'!r} "
                f"(state_dict order, buffers excluded); {len(ids)} ids, every state shape agrees")
    found = ", ".join(counts) if counts else "no model state_dict in the file"
    return {}, "none", f"not mapped: the optimizer has {len(ids)} parameters, model parameters found: {found}"


def _groups(walker: Collector, path: str, opt: dict) -> tuple[list[dict], list[int], list[str]]:
    """param_groups, their parameter ids and names, each checked: ids are ints, names strings."""
    groups = [g for g in opt["param_groups"] if isinstance(g, dict)]
    ids, pnames = [], []
    for i, g in enumerate(groups):
        params, names = g.get("params", []), g.get("param_names", [])
        if not (isinstance(params, (list, tuple)) and all(isinstance(p, int) and not isinstance(p, bool)
                                                          for p in params)):
            raise BadInputError(f"optimizer {path or 'state_dict'!r}: param_groups[{i}]['params'] is not a list of "
                                "integer ids", path=walker.ckpt.path, fix=FIX)
        if not (isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names)):
            raise BadInputError(f"optimizer {path or 'state_dict'!r}: param_groups[{i}]['param_names'] is not a list "
                                "of strings", path=walker.ckpt.path, fix=FIX)
        ids += params
        pnames += names
    return groups, ids, pnames


def read_optimizer(walker: Collector, path: str, opt: dict) -> OptimizerInfo:
    groups, ids, pnames = _groups(walker, path, opt)
    state = opt["state"]
    if pnames and len(pnames) == len(ids):
        prefix = next((m for m, sd in walker.models if pnames[0] in sd), "")
        names = {pid: join(prefix, n) for pid, n in zip(ids, pnames)}
        mapping, note = "param_names", "exact: the optimizer stored param_names"
    else:
        names, mapping, note = _order_mapping(ids, state, walker.models)
    if len(groups) > 1 and mapping == "order":
        note += f"; NB {len(groups)} param groups: if they were not built in model order, the names are wrong"
    for pid, slots in state.items():
        param = names.get(pid, str(pid))
        if not isinstance(slots, dict):
            continue
        for slot, v in slots.items():
            if isinstance(v, torch.Tensor):
                walker.add(f"{path or 'optimizer'}[{param}].{slot}", "optimizer", v, param=param, slot=slot)
    stateless = tuple(names.get(pid, str(pid)) for pid in ids if pid not in state) if state else ()
    return OptimizerInfo(path=path, n_params=len(ids), mapping=mapping, note=note, stateless=stateless,
                         groups=tuple(_hyper(g, names) for g in groups))


def _hyper(group: dict, names: dict) -> dict[str, Any]:
    """A param group's numeric hyperparameters (numbers, and pairs such as ``betas``) and its
    parameters' names: values read from a file, so anything else is dropped, never trusted."""
    out: dict[str, Any] = {}
    for k, v in group.items():
        if not isinstance(k, str) or k in ("params", "param_names"):
            continue
        if isinstance(v, bool):
            out[k] = v
        elif (num := number(v, float)) is not None:
            out[k] = num
        elif isinstance(v, (list, tuple)) and len(v) == 2 and all(number(x, float) is not None for x in v):
            out[k] = tuple(number(x, float) for x in v)
    out["params"] = [names.get(pid, str(pid)) for pid in group.get("params", [])]
    return out


def named_state_dict(entry: dict) -> dict:
    """A snapshot's optimizer ``state_dict`` with each group's ``param_names`` from the snapshot's
    ``param_names`` (one per param id, in param_groups order), so its state maps exactly to names;
    unchanged (mapped by order) when those names are missing, short or not all strings."""
    sd, names = entry["state_dict"], entry.get("param_names")
    groups = [g for g in sd["param_groups"] if isinstance(g, dict)]
    sizes = [len(g["params"]) if isinstance(g.get("params"), (list, tuple)) else -1 for g in groups]
    if not (isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names)
            and min(sizes, default=0) >= 0 and sum(sizes) == len(names)):
        return sd
    out, i = [], 0
    for g, n in zip(groups, sizes):
        out.append({**g, "param_names": list(names[i:i + n])})
        i += n
    return {**sd, "param_groups": out}



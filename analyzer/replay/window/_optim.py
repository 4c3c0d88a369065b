"""The optimizer at the rewind window's start, rebuilt: a ``torch.optim`` class by name, its state loaded.

The snapshot's ``rewind['optimizer']`` holds the class as a string (``"torch.optim.adam.Adam"``), the
``state_dict()`` and each parameter id's model name. Only classes of ``torch.optim`` itself are built, found
by name on the ``torch.optim`` package: no code named by a file is imported. The groups get the model's
parameters by name, in the order the state dict numbers them, and ``load_state_dict`` restores the
hyperparameters and the state (cast by torch to each parameter's dtype and device).
"""
from __future__ import annotations

from typing import Any

import torch

from ...errors import AnalyzerError
from ..runs._tree import map_tensors

__all__ = ["rebuild_optimizer", "set_hyperparameters"]

_FIX = "--steps replays the window of a run trained with a torch.optim optimizer; replay the snapshot's step alone"


def rebuild_optimizer(path: str, entry: dict, model: torch.nn.Module) -> torch.optim.Optimizer:
    """A ``torch.optim`` optimizer over `model`'s parameters in the state `entry` recorded (validated by
    ``load/_rewind.py``). Raises AnalyzerError for another class or parameters the model lacks."""
    cls_name = entry["class"]
    module, _, name = cls_name.rpartition(".")
    cls = getattr(torch.optim, name, None) if module.split(".")[:2] == ["torch", "optim"] else None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise AnalyzerError(f"the rewind window's optimizer {cls_name[:100]!r} is not a torch.optim class",
                            path=path, fix=_FIX)
    sd, names = entry["state_dict"], entry["param_names"]
    params = dict(model.named_parameters())
    groups, i = [], 0
    for g in sd["param_groups"]:
        group = []
        for _ in g["params"]:
            n = names[i] if i < len(names) else None
            if n not in params:
                raise AnalyzerError(f"the rewind window's optimizer holds parameter {str(n)[:80]!r}, which the "
                                    "rebuilt model lacks", path=path, fix="pass the factory that built this model "
                                    "with --factory")
            group.append(params[n])
            i += 1
        groups.append({"params": group})
    try:
        opt = cls(groups)
        opt.load_state_dict(_clone(sd))  # NB: loading keeps tensors of the right dtype as they are: a copy
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        raise AnalyzerError(f"the rewind window's {name} state does not load: {str(e).strip()[:160]}",
                            path=path, fix=_FIX) from e
    return opt


def set_hyperparameters(opt: torch.optim.Optimizer, groups: list[dict[str, Any]] | None) -> None:
    """Give each param group the hyperparameters it had when training stepped (``param_groups`` of the
    window's step: the lr a scheduler set); keys the group lacks are left out. None: as they are."""
    if groups is None or len(groups) != len(opt.param_groups):
        return
    for group, values in zip(opt.param_groups, groups):
        for k, v in values.items():
            if k not in group or k == "params":
                continue
            cur = group[k]
            if isinstance(cur, torch.Tensor):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    cur.fill_(v)
            elif isinstance(cur, tuple) and isinstance(v, (list, tuple)):
                group[k] = tuple(v)
            else:
                group[k] = v


def _clone(obj: Any) -> Any:
    return map_tensors(obj, torch.Tensor.clone)

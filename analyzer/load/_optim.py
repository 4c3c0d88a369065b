"""An optimizer ``state_dict()`` saved beside a checkpoint -> the snapshot's ``optimizer`` entry (update forensics).

An optimizer's state names its parameters by integer id, in ``param_groups`` order, never by
name. The caller gives the order it built them in (a model's ``named_parameters()``, the HF
Trainer's two groups); the ids are mapped back to names in that order, and the entry is kept only
when every group's size and every state tensor's shape fit it. Otherwise the note says why the
update forensics are unavailable, and the replay goes on without them.
"""
from __future__ import annotations

from typing import Any

import torch

from ._validate import check_dense

__all__ = ["optimizer_entry"]


def optimizer_entry(path, name: str, sd: Any, order: list[tuple[str, torch.Tensor]], sizes: list[int] | None,
                    grouping: str, adam: str = "torch.optim.adamw.AdamW") -> tuple[dict | None, str]:
    """``({"class", "state_dict", "param_names"} or None, note)`` for `sd` over the parameters `order`.

    Args:
        path: the file, named in errors (a non-dense tensor is refused: ``check_dense``).
        name: how the note names the state (``optimizer.pt``, ``the 'optimizer' entry``).
        order: (name, parameter) in the order the optimizer was given them.
        sizes: the group sizes that order implies; None: the groups must name their parameters
            (``param_names``, torch's named optimizers) or be one group.
        grouping: how the note words the order.
        adam: the class of an Adam-family state whose groups do not say ``decoupled_weight_decay``.
    """
    skip = f"{name} is not used (update forensics unavailable)"
    groups = sd.get("param_groups") if isinstance(sd, dict) else None
    states = sd.get("state") if isinstance(sd, dict) else None
    if not (isinstance(groups, list) and isinstance(states, dict) and all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
            and all(isinstance(st, dict) for st in states.values())):
        return None, f"{skip}: not an optimizer.state_dict()"
    ids = [i for g in groups for i in g["params"]]
    by_name = dict(order)
    named = [g.get("param_names") for g in groups]
    if sizes is None and all(isinstance(n, list) and len(n) == len(g["params"]) for n, g in zip(named, groups)):
        names = [n for group in named for n in group]  # torch's named optimizers say it themselves
        if not all(isinstance(n, str) and n in by_name for n in names):
            return None, f"{skip}: its param_names are not the model's parameters"
        order, grouping = [(n, by_name[n]) for n in names], "the parameter names it saved"
    else:
        want = sizes if sizes is not None else [len(order)]
        got = [len(g["params"]) for g in groups]
        if got != want:
            return None, f"{skip}: its parameter groups of {got} parameters are not {grouping} ({want})"
    at = {i: k for k, i in enumerate(ids)}
    for i, st in states.items():
        k = at.get(i)
        shapes = {tuple(v.shape) for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
        if k is None or shapes - {tuple(order[k][1].shape)}:
            return None, f"{skip}: the state of parameter id {i!r} does not fit the model's parameters"
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                check_dense(v, path=path, where=f"{name} state[{i!r}][{key!r}]")
    kinds = {key for st in states.values() for key in st}
    decoupled = {g.get("decoupled_weight_decay") for g in groups}
    cls = ((adam if decoupled == {None} else "torch.optim.adamw.AdamW" if decoupled == {True}
            else "torch.optim.adam.Adam") if {"exp_avg", "exp_avg_sq"} <= kinds
           else "torch.optim.sgd.SGD" if "momentum_buffer" in kinds else None)
    if cls is None:
        return None, f"{skip}: its state is neither Adam's nor SGD's"
    return ({"class": cls, "state_dict": sd, "param_names": [n for n, _ in order]},
            f"optimizer state: {name}, read as {cls.rsplit('.', 1)[1]} over {grouping} (used when the weights are "
            "already NaN/Inf: the update forensics)")

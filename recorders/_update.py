"""What the optimizer step did to the weights: the optimizer in files, check_update.

Failures born in the update leave finite gradients and broken or frozen weights:
Adam's ``eps=1e-8`` is 0 in float16, so a zero gradient gives ``0/0``; an update below half an
ulp of a BF16 weight rounds away. This module holds what the Recorder needs to see them, beside
the layer rows' update columns (``recorders._sample.UpdateSample``: ``update_rms`` and
``unchanged_frac`` on a fixed sample of each parameter):

- ``optimizer_meta`` / ``optimizer_entry``: the optimizer's class and hyperparameters for
  meta.json, and its ``state_dict()`` (copied to CPU, ``weights_only``-loadable) for snapshots.
- ``UpdateCheck``: ``check_update=True``'s test after every optimizer step, one fused norm over
  all parameters and one host sync; ``update_entry``: the ``update`` snapshot key.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .compiled import clean_name
from ._norms import norms
from ._stats import local_tensor

__all__ = ["UpdateCheck", "optimizer_class", "optimizer_meta", "optimizer_entry", "update_entry"]

_PRIMITIVES = (int, float, str, bool, type(None), torch.dtype, torch.device, torch.Size)


class UpdateCheck:
    """``check_update=True``: which parameters are non-finite right after an optimizer step.

    ``nonfinite()`` costs one fused L2 norm over all parameters and one host sync (the scalar
    sum of the norms); only when that is not finite does it look at each parameter (the cold
    path, where a float32 norm that overflowed on finite weights is also told apart).
    """

    def __init__(self, params: list[torch.Tensor], device: torch.device, single_device: bool):
        self.params = params
        self.device = device
        self.single_device = single_device
        self.acc = torch.float32 if device.type == "mps" else torch.float64

    def nonfinite(self) -> list[int]:
        """Indices of the parameters holding a NaN or Inf (``[]`` when all are finite)."""
        tensors = [local_tensor(p).detach() for p in self.params if p.numel()]
        if not tensors:
            return []
        total = norms(tensors, self.device, self.single_device).to(self.acc).sum()
        if math.isfinite(total.item()):  # NB: host sync: check_update's one per optimizer step
            return []
        return [i for i, p in enumerate(self.params)
                if p.numel() and not bool(torch.isfinite(local_tensor(p).detach()).all())]


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """``"torch.optim.adam.Adam"``: module and qualname, a string the analyzer never imports."""
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


_SKIP = object()


def _json_value(v: Any) -> Any:
    """A hyperparameter as JSON (numbers, strings, bools, None, lists of them), or _SKIP."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.is_complex():
            return _SKIP
        v = v.detach().cpu().item()  # a tensor lr (capturable/fused optimizers): setup time only
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v if not isinstance(v, str) or len(v) <= 200 else _SKIP
    if isinstance(v, int):
        return v if abs(v) < 2**63 else _SKIP
    if isinstance(v, float):
        return v if math.isfinite(v) else _SKIP
    if isinstance(v, (list, tuple)) and len(v) <= 16:
        out = [_json_value(x) for x in v]
        return _SKIP if any(x is _SKIP or isinstance(x, list) for x in out) else out
    return _SKIP


def optimizer_meta(optimizer: torch.optim.Optimizer | None, params: list[torch.Tensor]) -> dict | None:
    """meta.json's ``optimizer``: class and, per param group, its JSON-able hyperparameters.

    ``params`` in each group are indices into meta["params"] (`params`, model order); None for
    a tensor the optimizer holds that is not a parameter of the model.
    """
    if optimizer is None:
        return None
    index = {id(p): i for i, p in enumerate(params)}
    groups = []
    for group in optimizer.param_groups:
        entry = {}
        for k, v in group.items():
            if k != "params" and isinstance(k, str) and (jv := _json_value(v)) is not _SKIP:
                entry[k] = jv
        entry["params"] = [index.get(id(p)) for p in group["params"]]
        groups.append(entry)
    return {"class": optimizer_class(optimizer), "param_groups": groups}


def _plain(obj: Any, depth: int = 0) -> Any:
    """A copy holding only what ``torch.load(weights_only=True)`` reads: CPU tensors, containers, primitives.

    Anything else (a callable a custom optimizer keeps in its param groups) becomes its type name
    as a string, so one odd value never makes the snapshot unloadable.
    """
    if isinstance(obj, torch.Tensor):
        return local_tensor(obj).detach().to("cpu", copy=True)
    if isinstance(obj, _PRIMITIVES):
        return obj
    if depth < 32 and isinstance(obj, dict):
        return {(k if isinstance(k, (int, str)) else repr(k)[:200]): _plain(v, depth + 1) for k, v in obj.items()}
    if depth < 32 and isinstance(obj, (list, tuple)):
        items = [_plain(v, depth + 1) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return f"<{type(obj).__module__}.{type(obj).__qualname__}>"


def optimizer_entry(optimizer: torch.optim.Optimizer | None, names: dict[int, str]) -> dict | None:
    """The snapshot's ``optimizer``: class, ``state_dict()`` on CPU, and each param id's model name.

    `names` maps ``id(parameter)`` to its name in the model (``model_state`` keys). The state
    dict numbers parameters 0, 1, ... in param_groups order, so ``param_names[i]`` names id ``i``
    (None for a tensor that is not a parameter of the model).
    """
    if optimizer is None:
        return None
    state = optimizer.state_dict()
    param_names = [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
    return {"class": optimizer_class(optimizer), "state_dict": _plain(state), "param_names": param_names}


def update_entry(model: torch.nn.Module, nonfinite: list[str]) -> dict:
    """The ``update`` snapshot key: this step's gradients as the optimizer used them, the new weights."""
    grads, post = {}, {}
    for name, p in model.named_parameters():
        name = clean_name(name)  # a submodule compiled with torch.compile: no _orig_mod. segment
        post[name] = local_tensor(p).detach().to("cpu", copy=True)
        if p.grad is not None:
            g = local_tensor(p.grad).detach()
            grads[name] = (g.to_dense() if g.layout != torch.strided else g).to("cpu", copy=True)
    return {"grads": grads, "post_params": post, "nonfinite_params": list(nonfinite)}

"""The ``compile`` entry of meta.json and snapshots (format version 5): how training torch.compile'd the model.

``read_compile`` checks the entry (``recorders.schema``, after ``KEYS_ADDED``) and returns it
as plain values; ``strip_orig_mod`` maps the ``_orig_mod.`` keys that older snapshots of a
compiled model hold onto the original module's names.

Example:
    >>> read_compile({"modules": [{"path": "", "how": "torch.compile", "backend": "inductor"}]})["modules"][0]["mode"]
    >>> strip_orig_mod({"_orig_mod.fc1.weight": 1})
    {'fc1.weight': 1}
"""
from __future__ import annotations

from typing import Any

__all__ = ["COMPILE_FIELDS", "read_compile", "strip_orig_mod", "clean_old_names", "clean_name"]

COMPILE_FIELDS = ("path", "how", "backend", "mode", "dynamic", "fullgraph", "options")
_HOWS = ("torch.compile", "module.compile")
_ORIG_MOD = "_orig_mod"


def read_compile(entry: Any) -> dict | None:
    """None, or ``{"modules": [{field: value for COMPILE_FIELDS}]}``; raise ValueError saying what is wrong."""
    if entry is None:
        return None
    modules = entry.get("modules") if isinstance(entry, dict) else None
    if not isinstance(modules, list) or not modules or len(modules) > 100_000:
        raise ValueError("should be None or {'modules': [{'path', 'how', 'backend', 'mode', 'dynamic', "
                         "'fullgraph', 'options'}, ...]}")
    out = []
    for i, m in enumerate(modules):
        if not isinstance(m, dict) or not isinstance(m.get("path"), str) or m.get("how") not in _HOWS:
            raise ValueError(f"modules[{i}] should have a string 'path' and 'how' one of {list(_HOWS)}")
        for key in ("backend", "mode"):
            if not isinstance(m.get(key), (str, type(None))):
                raise ValueError(f"modules[{i}]['{key}'] should be a string or None")
        for key in ("dynamic", "fullgraph"):
            if not isinstance(m.get(key), (bool, type(None))):
                raise ValueError(f"modules[{i}]['{key}'] should be True, False or None")
        options = m.get("options")
        if options is not None and (not isinstance(options, dict) or not all(isinstance(k, str) for k in options)):
            raise ValueError(f"modules[{i}]['options'] should be None or a dict with string keys")
        out.append({k: m.get(k) for k in COMPILE_FIELDS})
    return {"modules": out}


def strip_orig_mod(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with torch.compile's ``_orig_mod`` path segments left out of every key (`state` if none has one)."""
    if not any(_ORIG_MOD in k for k in state):
        return state
    return {".".join(p for p in k.split(".") if p != _ORIG_MOD): v for k, v in state.items()}


def clean_old_names(snap: dict[str, Any]) -> dict[str, Any]:
    """A snapshot older than version 5 of a ``torch.compile(model)``, with its names as version 5 writes them.

    Its ``model_state``, ``optimizer`` param_names and ``update`` entries lose their ``_orig_mod``
    segments, so reports and replays name ``fc1.weight``. `snap` itself when no name has one.
    """
    state = snap.get("model_state")
    if not isinstance(state, dict) or not any(isinstance(k, str) and _ORIG_MOD in k for k in state):
        return snap
    if not all(isinstance(k, str) for k in state):
        return snap
    out = dict(snap, model_state=strip_orig_mod(state))
    optimizer = snap.get("optimizer")
    if isinstance(optimizer, dict) and isinstance(optimizer.get("param_names"), list):
        out["optimizer"] = dict(optimizer, param_names=[clean_name(n) for n in optimizer["param_names"]])
    update = snap.get("update")
    if isinstance(update, dict):
        fixed = dict(update)
        for key in ("grads", "post_params"):
            if isinstance(update.get(key), dict) and all(isinstance(k, str) for k in update[key]):
                fixed[key] = strip_orig_mod(update[key])
        if isinstance(update.get("nonfinite_params"), list):
            fixed["nonfinite_params"] = [clean_name(n) for n in update["nonfinite_params"]]
        out["update"] = fixed
    return out


def clean_name(name: Any) -> Any:
    return ".".join(p for p in name.split(".") if p != _ORIG_MOD) if isinstance(name, str) else name

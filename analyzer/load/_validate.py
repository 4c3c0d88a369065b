"""Validate values read from files before any analysis touches them.

Loaders call these so that replay, report and inspect can trust what they get: a snapshot's keys
have the types and ranges the recorder writes, nesting is bounded (a 100k-deep list is refused
here, not met as a RecursionError later), and every tensor is backed by its own bytes. The last
rule is what bounds memory: an 867-byte snapshot can hold a stride-0 view declaring 3e9 elements,
and anything that materialises it (``isfinite``, ``.to(device)``, a forward) allocates 12 GB.
Every failure is a one-line ``BadInputError`` naming the file, the key and the fix.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch

from recorders import schema

from ._dense import check_dense
from .ddp import read_ddp
from ._limits import check_nesting
from ..errors import BadInputError

__all__ = ["check_nesting", "validate_snapshot", "check_optimizer_entry", "check_named_tensors",
           "walk_tensors"]

_REFIX = "the snapshot is damaged or was not written by the amp-autopsy Recorder; re-record the run"
_MAX_TEXT = 4096
_MAX_KEY = 64  # a spike entry's texts: a reason or metric name


def walk_tensors(obj: Any, prefix: str):
    """(where, tensor) for every tensor leaf; nesting is already bounded by check_nesting."""
    stack = [(obj, prefix)]
    while stack:
        cur, where = stack.pop()
        if isinstance(cur, torch.Tensor):
            yield where, cur
        elif isinstance(cur, dict):
            stack.extend((v, f"{where}[{k!r}]") for k, v in cur.items())
        elif isinstance(cur, (list, tuple)):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(cur))


def _bad(key: str, detail: str, path) -> BadInputError:
    return BadInputError(f"snapshot {key!r} {detail}", path=path, fix=_REFIX)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_text(snap: dict, key: str, path, *, optional: bool) -> None:
    v = snap.get(key)
    if v is None and optional:
        return
    if not isinstance(v, str) or len(v) > _MAX_TEXT:
        raise _bad(key, f"should be a string (up to {_MAX_TEXT} characters), got {type(v).__name__}", path)


def _check_int(snap: dict, key: str, path, lo: int) -> None:
    v = snap.get(key)
    if not _is_int(v) or not lo <= v < 2**63:
        raise _bad(key, f"should be an integer >= {lo}, got {v!r}"[:200], path)


def _check_real(snap: dict, key: str, path, *, finite: bool = False) -> None:
    v = snap.get(key)
    if v is None:
        return
    if not _is_real(v) or (finite and not math.isfinite(v)):
        kind = "a finite number" if finite else "a number"
        raise _bad(key, f"should be {kind} or None, got {v!r}"[:200], path)


def _check_scaler_state(state: Any, path) -> None:
    if state is None:
        return
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise _bad("scaler_state", "should be a GradScaler.state_dict() (a dict) or None", path)
    for key in ("scale", "growth_factor", "backoff_factor"):
        v = state.get(key)
        if v is not None and not (_is_real(v) and math.isfinite(v) and v > 0):
            if key == "scale" and isinstance(v, torch.Tensor) and v.numel() == 1:
                continue  # GradScaler.state_dict() gives a float; a one-element tensor is tolerated
            raise _bad("scaler_state", f"{key} should be a positive finite number, got {v!r}"[:200], path)
    for key in ("growth_interval", "_growth_tracker"):
        v = state.get(key)
        if v is not None and not (_is_int(v) and 0 <= v < 2**63):
            raise _bad("scaler_state", f"{key} should be a non-negative integer, got {v!r}"[:200], path)


def _check_model_state(state: Any, path) -> None:
    if not isinstance(state, dict):
        raise _bad("model_state", f"should be a dict of name -> tensor, got {type(state).__name__}", path)
    for name, t in state.items():
        if not isinstance(name, str):
            raise _bad("model_state", f"has a non-string key {name!r}"[:200], path)
        if not isinstance(t, torch.Tensor):
            raise _bad("model_state", f"entry {name!r} is a {type(t).__name__}, not a tensor"[:200], path)
        check_dense(t, path=path, where=f"model_state[{name!r}]")


def _check_rng(rng: Any, path) -> None:
    from .rngfile import check_rng_state  # one reader of the RNG format: snapshots and --rng files

    check_rng_state(rng, path=path, what="snapshot 'rng'", fix=_REFIX)


def _check_sdpa(sdpa: Any, path) -> None:
    """None, or ``{"enabled": {backend: bool}, "math_reduced_precision": bool | None}`` (version 3)."""
    if sdpa is None:
        return
    enabled = sdpa.get("enabled") if isinstance(sdpa, dict) else None
    if (not isinstance(enabled, dict) or set(enabled) != set(schema.SDPA_BACKENDS)
            or not all(isinstance(v, bool) for v in enabled.values())
            or not isinstance(sdpa.get("math_reduced_precision"), (bool, type(None)))):
        shape = ", ".join(f"'{b}': bool" for b in schema.SDPA_BACKENDS)
        raise _bad("sdpa", f"should be None or {{'enabled': {{{shape}}}, 'math_reduced_precision': bool | None}}",
                   path)


def _check_spike(spike: Any, path) -> None:
    """None, or the measurement of a spike snapshot (version 7): ``schema.SPIKE_KEYS``, each a number, a
    short text or None (``recorders/_spikes.py``)."""
    if spike is None:
        return
    ok = (isinstance(spike, dict) and set(spike) <= set(schema.SPIKE_KEYS)
          and all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
                  or (isinstance(v, str) and len(v) <= _MAX_KEY) for v in spike.values()))
    if not ok:
        raise _bad("spike", f"should be None or a dict of {', '.join(schema.SPIKE_KEYS)}: numbers, short texts or None",
                   path)


def _check_fp8(fp8: Any, recipe: Any, path) -> None:
    """None, or the FP8 entries (version 8): ``fp8_recipe`` a dict; ``fp8`` a dict of ``schema.FP8_KEYS`` whose
    casts are None or a list of dicts of ``schema.FP8_CAST_KEYS`` (``recorders/_fp8_watch.py``)."""
    if recipe is not None and not isinstance(recipe, dict):
        raise _bad("fp8_recipe", "should be None or a dict (describe_fp8's recipe)", path)
    if fp8 is None:
        return
    casts = fp8.get("casts") if isinstance(fp8, dict) else None
    fired = fp8.get("fired") if isinstance(fp8, dict) else None
    rows = (casts or []) + ([fired] if fired is not None else []) if isinstance(casts, (list, type(None))) else None
    ok = (isinstance(fp8, dict) and set(fp8) <= set(schema.FP8_KEYS) and rows is not None
          and all(isinstance(c, dict) and set(c) <= set(schema.FP8_CAST_KEYS) for c in rows)
          and isinstance(fp8.get("transformer_engine"), (dict, type(None))))
    if not ok:
        raise _bad("fp8", f"should be None or a dict of {', '.join(schema.FP8_KEYS)} whose casts are dicts of "
                   f"{', '.join(schema.FP8_CAST_KEYS[:4])}, ...", path)


_FSDP_KEYS = ("dcp_dir", "mp_policy", "mesh", "world_size", "local_state", "layout", "modules")
_MAX_MODULES = 1 << 16


def _check_fsdp(fsdp: Any, path) -> None:
    """None, or a sharded model's entry (version 3, ``schema.SNAPSHOT_KEYS``): the DCP directory
    is one plain name under snapshots/ (never a path: a file must not point replay elsewhere)."""
    if fsdp is None:
        return
    if not isinstance(fsdp, dict) or not set(fsdp) <= set(_FSDP_KEYS) or "world_size" not in fsdp:
        raise _bad("fsdp", f"should be None or a dict with keys {list(_FSDP_KEYS)}", path)
    dcp_dir = fsdp.get("dcp_dir")
    if dcp_dir is not None and not (isinstance(dcp_dir, str) and schema.DCP_RE.match(dcp_dir)):
        raise _bad("fsdp", f"dcp_dir should be a name like 'step00000042-nonfinite_loss.dcp', got {dcp_dir!r}"[:200],
                   path)
    ws = fsdp.get("world_size")
    if not _is_int(ws) or not 1 <= ws < 2**31:
        raise _bad("fsdp", f"world_size should be an integer >= 1, got {ws!r}"[:200], path)
    policy = fsdp.get("mp_policy")
    if policy is not None and (not isinstance(policy, dict) or not all(
            isinstance(v, (str, type(None))) and (v is None or len(v) < 64) for v in policy.values())):
        raise _bad("fsdp", "mp_policy should be None or a dict of dtype names (or None)", path)
    if fsdp.get("mesh") is not None and not isinstance(fsdp["mesh"], dict):
        raise _bad("fsdp", "mesh should be None or a dict", path)
    local = fsdp.get("local_state")
    if local is not None:
        if not isinstance(local, dict):
            raise _bad("fsdp", "local_state should be None or a dict of name -> tensor", path)
        for name, t in local.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise _bad("fsdp", f"local_state entry {name!r} is not a named tensor"[:200], path)
            check_dense(t, path=path, where=f"fsdp['local_state'][{name!r}]")
    _check_fsdp_modules(fsdp.get("modules"), path)
    layout = fsdp.get("layout")
    if layout is not None and not (isinstance(layout, dict) and all(
            isinstance(v, dict) and isinstance(v.get("shape"), list) for v in layout.values())):
        raise _bad("fsdp", "layout should be None or a dict of name -> {'shape': [...], 'offset': [...]}", path)


def _check_fsdp_modules(modules: Any, path) -> None:
    """None (before version 8), or the ``fully_shard``-ed modules: path, policy, divide factor."""
    if modules is None:
        return
    if not isinstance(modules, list) or len(modules) > _MAX_MODULES:
        raise _bad("fsdp", "modules should be None or a list of {'path', 'mp_policy', 'gradient_divide_factor'}", path)
    for m in modules:
        factor = m.get("gradient_divide_factor") if isinstance(m, dict) else None
        policy = m.get("mp_policy") if isinstance(m, dict) else None
        ok = (isinstance(m, dict) and set(m) <= {"path", "mp_policy", "gradient_divide_factor"}
              and isinstance(m.get("path"), str) and len(m["path"]) <= 1024
              and (factor is None or (isinstance(factor, (int, float)) and not isinstance(factor, bool)
                                      and math.isfinite(factor) and factor > 0))
              and (policy is None or (isinstance(policy, dict) and all(
                  isinstance(v, (str, type(None))) and (v is None or len(v) < 64) for v in policy.values()))))
        if not ok:
            raise _bad("fsdp", f"modules entry {str(m)[:120]!r} is not a sharded module's path, policy and "
                               "positive divide factor", path)


def _check_named_tensors(d: Any, key: str, field: str, path) -> None:
    if not isinstance(d, dict):
        raise _bad(key, f"{field} should be a dict of name -> tensor", path)
    for name, t in d.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise _bad(key, f"{field} entry {name!r} is not a named tensor"[:200], path)
        check_dense(t, path=path, where=f"{key}[{field!r}][{name!r}]")


def _check_optimizer(opt: Any, path, key: str = "optimizer") -> None:
    """None, or {"class": str, "state_dict": {"state": dict, "param_groups": [dict]}, "param_names": [...]}.

    `key` names the entry in errors (``"rewind"``: the optimizer state at the rewind window's start)."""
    if opt is None:
        return
    what = "" if key == "optimizer" else "optimizer: "
    if not isinstance(opt, dict) or set(opt) != {"class", "state_dict", "param_names"}:
        raise _bad(key, what + "should be None or a dict with keys 'class', 'state_dict', 'param_names'", path)
    if not isinstance(opt["class"], str) or len(opt["class"]) > _MAX_TEXT:
        raise _bad(key, what + "class should be a string like 'torch.optim.adam.Adam'", path)
    sd = opt["state_dict"]
    if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict) \
            or not isinstance(sd.get("param_groups"), list) \
            or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                       and all(_is_int(i) for i in g["params"]) for g in sd["param_groups"]):
        raise _bad(key, what + "state_dict should be an optimizer.state_dict(): 'state' (a dict) and "
                                "'param_groups' (dicts whose 'params' are integer ids)", path)
    if not all(_is_int(k) and isinstance(v, dict) and all(isinstance(f, str) for f in v)
               for k, v in sd["state"].items()):
        raise _bad(key, what + "state_dict 'state' should map integer parameter ids to dicts of named values", path)
    names = opt["param_names"]
    if not isinstance(names, list) or not all(n is None or (isinstance(n, str) and len(n) <= _MAX_TEXT)
                                              for n in names):
        raise _bad(key, what + "param_names should be a list of parameter names (or None)", path)
    prefix = "optimizer['state_dict']" if key == "optimizer" else f"{key}['optimizer']['state_dict']"
    for where, t in walk_tensors(sd, prefix):
        check_dense(t, path=path, where=where)


check_optimizer_entry = _check_optimizer
check_named_tensors = _check_named_tensors


def _check_update(update: Any, path) -> None:
    """None, or {"grads": {name: tensor}, "post_params": {name: tensor}, "nonfinite_params": [name]}."""
    if update is None:
        return
    if not isinstance(update, dict) or set(update) != {"grads", "post_params", "nonfinite_params"}:
        raise _bad("update", "should be None or a dict with keys 'grads', 'post_params', 'nonfinite_params'", path)
    _check_named_tensors(update["grads"], "update", "grads", path)
    _check_named_tensors(update["post_params"], "update", "post_params", path)
    bad = update["nonfinite_params"]
    if not isinstance(bad, list) or not all(isinstance(n, str) and len(n) <= _MAX_TEXT for n in bad):
        raise _bad("update", "nonfinite_params should be a list of parameter names", path)


def _check_exception(entry: Any, path) -> None:
    """None, or on reason "exception" (version 4) the exception the step raised (``load/exceptions.py``)."""
    from .exceptions import read_exception

    try:
        read_exception(entry)
    except ValueError as e:
        raise _bad("exception", str(e), path) from e


def _check_compile(entry: Any, path) -> None:
    """None, or how training compiled the model (version 5, ``load/compiled.py``)."""
    from .compiled import read_compile

    try:
        read_compile(entry)
    except ValueError as e:
        raise _bad("compile", str(e), path) from e


def validate_snapshot(snap: dict[str, Any], path: str | os.PathLike) -> None:
    """Check every key of a loaded snapshot (``schema.SNAPSHOT_KEYS``); raise BadInputError."""
    for key in ("torch_version", "amp_autopsy_version", "host", "reason", "device_type"):
        _check_text(snap, key, path, optional=key in ("amp_autopsy_version", "host"))
    for key in ("factory", "loss_fn", "amp_dtype", "loss_dtype", "cwd"):
        _check_text(snap, key, path, optional=True)
    _check_int(snap, "rank", path, 0)
    _check_int(snap, "world_size", path, 1)
    _check_int(snap, "step", path, -2**63)
    _check_real(snap, "created", path, finite=True)
    _check_real(snap, "scale", path)
    _check_real(snap, "loss", path)
    _check_real(snap, "grad_norm", path)
    if not isinstance(snap.get("train_mode"), bool):
        raise _bad("train_mode", f"should be True or False, got {snap.get('train_mode')!r}"[:200], path)
    kwargs = snap.get("factory_kwargs")
    if kwargs is not None and (not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs)):
        raise _bad("factory_kwargs", "should be a dict with string keys", path)
    _check_scaler_state(snap.get("scaler_state"), path)
    _check_model_state(snap.get("model_state"), path)
    _check_rng(snap.get("rng"), path)
    _check_sdpa(snap.get("sdpa"), path)
    _check_fsdp(snap.get("fsdp"), path)
    _check_optimizer(snap.get("optimizer"), path)
    _check_update(snap.get("update"), path)
    _check_exception(snap.get("exception"), path)
    _check_compile(snap.get("compile"), path)
    _check_spike(snap.get("spike"), path)
    _check_fp8(snap.get("fp8"), snap.get("fp8_recipe"), path)
    try:
        read_ddp(snap.get("ddp"))
    except ValueError as e:
        raise _bad("ddp", str(e), path) from e
    for where, t in walk_tensors(snap.get("batch"), "batch"):
        check_dense(t, path=path, where=where)

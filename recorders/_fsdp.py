"""FSDP2 (``fully_shard``) support of the Recorder: policy and mesh, shard layout, sharded snapshots.

Under ``fully_shard`` every parameter is a ``DTensor`` whose local tensor is this rank's shard.
The Recorder measures the local shards only (no collective on the step) and writes, per rank,
where each shard sits (``shard_layout``), so the analyzer can merge shard statistics into
whole-parameter values offline: the global norm is the square root of the sum of the squared
shard norms, non-finite counts add up, zero fractions are weighted by the shard sizes.

Snapshots of a sharded model cannot hold the weights in one rank's file. Two ways, chosen so
that no rank ever waits for another that will not come:

- collective (``save_dcp``): every rank writes its shards of the pre-step weights, buffers
  and optimizer state into one ``torch.distributed.checkpoint`` (DCP) directory. Only where
  every rank is known to arrive: with ``sync_failures=True``, after the ranks agreed on the
  failure and on snapshotting it (``Recorder._sync_failure``).
- local (``local_state``): otherwise, a failing rank saves its own shards (``to_local()``)
  and their offsets in its snapshot file. No collective, so one failing rank never deadlocks;
  the whole model is only known if every rank wrote such a snapshot of that step.

Everything here reads FSDP's state defensively: private attributes that move between torch
versions give None, never an exception in the training loop.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from . import schema
from . import triggers as _triggers
from .compiled import clean_name

__all__ = ["FsdpSnapshots", "is_sharded", "fsdp_meta", "sharded_modules", "shard_layout", "local_state", "save_dcp"]


def is_sharded(t: torch.Tensor) -> bool:
    """A DTensor (an FSDP2 parameter or gradient); plain tensors are not."""
    return callable(getattr(t, "to_local", None)) and hasattr(t, "device_mesh")


def _policy_of(state: Any) -> dict[str, str | None] | None:
    """``param_dtype``/``reduce_dtype``/``output_dtype`` of one module's FSDP state, or None.

    NB: torch 2.13 keeps it on ``FSDPModule._get_fsdp_state()._mp_policy`` (a
    ``MixedPrecisionPolicy``) and on each ``FSDPParamGroup.mp_policy``; both are private.
    """
    try:
        policy = getattr(state, "_mp_policy", None)
        if policy is None:
            group = getattr(state, "_fsdp_param_group", None)
            policy = getattr(group, "mp_policy", None)
    except Exception:  # noqa: BLE001 - a private API that moved: the policy is unknown
        return None
    if policy is None:
        return None
    return {k: schema.dtype_name(getattr(policy, k, None)) for k in ("param_dtype", "reduce_dtype", "output_dtype")}


def _policy(model: torch.nn.Module) -> dict[str, str | None] | None:
    """The policy of the outermost FSDP module, or None."""
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if callable(get_state):
            try:
                return _policy_of(get_state())
            except Exception:  # noqa: BLE001 - a private API that moved: the policy is unknown
                return None
    return None


def _divide_factor(state: Any) -> float | None:
    """The module's ``set_gradient_divide_factor`` value; None: FSDP2's default (the mean over the
    data-parallel ranks; FP16 reductions divided partly before the sum and partly after).

    NB: torch 2.13 keeps it on each ``FSDPParamGroup.gradient_divide_factor`` (private).
    """
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [] if one is None else [one]
    for group in groups:
        factor = getattr(group, "gradient_divide_factor", None)
        if isinstance(factor, (int, float)) and not isinstance(factor, bool):
            return float(factor)
    return None


def sharded_modules(model: torch.nn.Module) -> list[dict[str, Any]] | None:
    """Every ``fully_shard``-ed module, outermost first: ``path`` (``""``: the root), ``mp_policy``
    and ``gradient_divide_factor``: where the distributed replay applies ``fully_shard`` again and
    what shapes each module's gradient reduction. None when FSDP's state cannot be read.
    """
    out = []
    try:
        for path, module in model.named_modules():
            get_state = getattr(module, "_get_fsdp_state", None)
            if not callable(get_state):
                continue
            state = get_state()
            out.append({"path": clean_name(path), "mp_policy": _policy_of(state),
                        "gradient_divide_factor": _divide_factor(state)})
    except Exception:  # noqa: BLE001 - a private API that moved: the layout is unknown
        return None
    return out


def _placement(p: Any) -> str:
    """A DTensor placement as a stable name: ``replicate``, ``shard(D)``, ``partial``, else its ``str()``."""
    if p.is_replicate():
        return "replicate"
    if p.is_shard():
        return f"shard({int(p.dim)})"
    return "partial" if p.is_partial() else str(p)


def _mesh(params: list[torch.Tensor]) -> dict[str, Any] | None:
    """The device mesh of the first sharded parameter: device type, shape, dimension names, and (format 9)
    its placements on each dimension (``_placement``), ``["replicate", "shard(0)"]`` under HSDP: what tells
    HSDP from FSDP2 with another parallelism on a 2-D mesh."""
    for p in params:
        mesh = getattr(p, "device_mesh", None) if is_sharded(p) else None
        if mesh is None:
            continue
        try:
            names = mesh.mesh_dim_names
            placements = getattr(p, "placements", None)
            return {"device_type": str(mesh.device_type), "shape": [int(d) for d in mesh.shape],
                    "dim_names": None if names is None else [str(n) for n in names],
                    "placements": None if placements is None else [_placement(x) for x in placements]}
        except Exception:  # noqa: BLE001 - an unfamiliar mesh object: unknown
            return None
    return None


def fsdp_meta(model: torch.nn.Module, params: list[torch.Tensor], world_size: int) -> dict[str, Any] | None:
    """meta.json's and the snapshots' ``fsdp`` entry: None unless some parameter is sharded.

    ``modules`` (format 8): ``sharded_modules``, each ``fully_shard``-ed module with its policy and
    gradient divide factor.
    """
    if not any(is_sharded(p) for p in params):
        return None
    return {"mp_policy": _policy(model), "mesh": _mesh(params), "world_size": int(world_size),
            "modules": sharded_modules(model)}


def shard_layout(t: torch.Tensor) -> dict[str, Any] | None:
    """This rank's shard of a DTensor: ``local_shape``, ``local_numel``, ``local_offset``; None if plain.

    The offset is where the shard starts in the whole tensor (FSDP2 shards dim 0 in chunks; an
    uneven split leaves the last ranks short or empty). No collective.
    """
    if not is_sharded(t):
        return None
    local = t.to_local()
    offset = None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        offset = [int(o) for o in off]
    except Exception:  # noqa: BLE001 - a private helper that moved: the offset is unknown
        pass
    return {"local_shape": list(local.shape), "local_numel": local.numel(), "local_offset": offset}


def local_state(model: torch.nn.Module, pre_step_buffers: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(``{name: CPU tensor}``, ``{name: {"shape", "offset"}}``): this rank's shards, no collective.

    Parameters are the local shards (``to_local()``); buffers are whole (FSDP2 does not shard
    them), with their pre-step values where the forward wrote them in place.
    """
    state, layout = {}, {}
    for name, value in model.state_dict().items():
        name = clean_name(name)  # a submodule compiled with torch.compile: no _orig_mod. segment
        value = pre_step_buffers.get(name, value)
        info = shard_layout(value)
        if info is not None:
            layout[name] = {"shape": list(value.shape), "offset": info["local_offset"]}
            value = value.to_local()
        state[name] = value.detach().to("cpu", copy=True)
    return state, layout


def save_dcp(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             pre_step_buffers: dict[str, torch.Tensor]) -> Path:
    """Write ``{"model": ..., "optim": ...}`` as one DCP checkpoint in `directory`. COLLECTIVE.

    NB: every rank must call this for the same directory, or the others wait forever: callers
    reach it only after the ranks agreed (``Recorder._sync_failure``). ``optim`` is left out when
    the Recorder has no optimizer. The weights are those the failing forward used (end_step runs
    before the optimizer step); buffers the forward wrote in place get their pre-step values.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_sd = get_model_state_dict(model)
    for name, value in pre_step_buffers.items():
        if name in model_sd:
            model_sd[name] = value.detach().clone()
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=str(directory))
    return directory


def _listing(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []


class FsdpSnapshots:
    """Mixin of ``Recorder`` (before ``StepStats``): the collective-or-local choice of a sharded
    model's snapshot. Reads the Recorder's ``_fsdp``, ``_step``, ``run_dir``, ``model``,
    ``optimizer`` and ``_guard``; a model that is not sharded (``_fsdp`` None) adds nothing.
    """

    def _sync_failure(self, failure, snap_reason):
        """``StepStats._sync_failure``, then, for a sharded model on a failing step, one more tiny
        all-reduce: do all ranks snapshot this step (then the snapshot is one collective DCP
        save), and under which reason is its directory named (the first in ``triggers.REASONS``
        any rank hit)? Every rank enters it: ``_peer_failing`` came from the collective above.
        """
        failure, snap_reason = super()._sync_failure(failure, snap_reason)
        self._dcp_ok, self._dcp_reason = False, None
        if self._fsdp is None or not self._peer_failing:
            return failure, snap_reason
        dist = torch.distributed
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")
        reasons = _triggers.REASONS
        code = len(reasons) - reasons.index(failure) if failure in reasons else 0
        # a DCP directory of this step left by an earlier process (a resumed run) is never written over
        taken = any(schema.DCP_RE.match(n) and int(schema.DCP_RE.match(n)[1]) == self._step
                    for n in _listing(self.run_dir / schema.SNAPSHOT_DIR))
        flags = torch.tensor([0.0 if snap_reason is not None else 1.0, float(code), float(taken)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        some_missing, best, some_taken = flags.tolist()  # NB: host sync: failing steps only, after the collective
        self._dcp_ok = some_missing == 0.0 and some_taken == 0.0 and snap_reason is not None
        self._dcp_reason = reasons[len(reasons) - int(best)] if best > 0 else _triggers.PEER_FAILURE
        return failure, snap_reason

    def _fsdp_snapshot(self, reason: str, pre: dict) -> dict:
        """A sharded model's ``fsdp`` snapshot entry: its weights in a DCP directory, or local shards.

        Collective (one DCP directory for every rank) only when ``_sync_failure`` found that every
        rank snapshots this step; otherwise (no sync_failures, a manual snapshot, a rank out of
        snapshots) this rank's own shards go into its file, with no collective: one failing rank
        never waits for the others.
        """
        # the divide factor as this step reduced with it (a loop may set it after the Recorder was made)
        entry = dict(self._fsdp, dcp_dir=None, local_state=None, layout=None, modules=sharded_modules(self.model))
        if self._dcp_ok and self._dcp_reason is not None:
            self._dcp_ok = False
            name = schema.dcp_dir_name(self._step, self._dcp_reason)
            done = self._guard(f"write the DCP snapshot {name}", save_dcp,
                               self.run_dir / schema.SNAPSHOT_DIR / name, self.model, self.optimizer, pre)
            if done is not None:
                entry["dcp_dir"] = name
                return entry
        entry["local_state"], entry["layout"] = local_state(self.model, pre)
        return entry

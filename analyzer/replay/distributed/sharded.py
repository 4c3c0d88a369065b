"""One rank's rebuilt model in a distributed replay: ``fully_shard`` as recorded, this rank's shards from DCP.

``ShardedContext`` is the ``ReplayContext`` of one rank: every run (``_runs.run_once``) builds the model
from the factory, applies ``fully_shard`` at each recorded sharded module (innermost first) with the
run's ``MixedPrecisionPolicy`` and the recorded gradient divide factor, and loads this rank's shards
from the snapshot's DCP directory (``dcp.load`` reshards when the rank count differs from the
recorded one). An HSDP snapshot (a 2-D mesh, replicate x shard) gets the recorded mesh back (``mesh``): its
parameters sharded within each shard group, its gradients reduce-scattered there and all-reduced across the
replicas, as training did. The dispatch mode (``_CollectiveMode``) waits on each collective before it measures
the collective's output, so a reduce-scatter's statistic is the reduced value, not an unfinished buffer.

The policy per run: ``float32`` has none (FP32 compute and reductions: the reference); a low precision
has the recorded ``param_dtype``, ``reduce_dtype`` and ``output_dtype`` of each module, with
``reduce_dtype`` replaced by ``reduce_override`` in a fix's run.
"""
from __future__ import annotations

import gc
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from recorders import schema

from ...errors import BadInputError
from ..runs._attribution import _flat
from ..runs._mode import _OpStatsMode
from ..runs._runs import ReplayContext
from ..result.trace import RunTrace

__all__ = ["ShardedContext", "CollectiveFailed", "COLLECTIVE_NAMESPACES", "is_collective", "is_plumbing",
           "sharded_layout", "bad_shards"]

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
_PLUMBING = ("fsdp", "profiler")  # FSDP2's own copies around its collectives, and profiler markers
# record_function regions whose ops move values around a collective: FSDP2's hooks, the replay's DDP hook
_HOOK_REGIONS = ("FSDP::", "DDP::")


def is_collective(namespace: str) -> bool:
    return namespace in COLLECTIVE_NAMESPACES


def is_plumbing(namespace: str) -> bool:
    """Collectives and FSDP's copies: ops that move values between ranks and buffers, computing nothing."""
    return namespace in COLLECTIVE_NAMESPACES or namespace in _PLUMBING


def sharded_layout(path: str, fsdp: Mapping) -> tuple[tuple[dict, ...], str | None]:
    """The recorded ``fully_shard``-ed modules (outermost first), and a note when the snapshot predates them.

    A snapshot before format 8 does not say which modules were sharded: its root alone is sharded with
    the recorded policy, which casts and reduces as every module did when they shared that policy.
    """
    modules = fsdp.get("modules")
    if modules:
        return tuple(modules), None
    return ({"path": "", "mp_policy": fsdp.get("mp_policy"), "gradient_divide_factor": None},), (
        "the snapshot predates format 8 and does not say which modules were fully_shard-ed: the root alone is "
        "sharded, with the recorded policy and FSDP2's default gradient divide factor")


class _Waits(dict):
    """``_OpStatsMode.override`` that runs a collective and waits for it; any other op as the base has it."""

    def __init__(self, mode: _CollectiveMode, base: dict | None):
        super().__init__(base or {})
        self._mode = mode

    def __bool__(self) -> bool:
        return True

    def get(self, index, default=None):
        fn = super().get(index, default)
        return _run_and_wait if fn is None and self._mode.in_collective else fn


class CollectiveFailed(RuntimeError):
    """A collective of the replayed step raised: a peer rank died, or did not answer within the timeout."""


def _run_and_wait(func, args, kwargs):
    try:
        out = func(*args, **kwargs)
        for x in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(x, torch.ScriptObject) and x._has_method("wait"):  # c10d's Work
                x.wait()
        if func.namespace == "_c10d_functional" and isinstance(out, torch.Tensor) and "wait" not in str(func):
            torch.ops._c10d_functional.wait_tensor(out)
    except Exception as e:  # noqa: BLE001 - gloo raises a plain RuntimeError for a peer that is gone
        raise CollectiveFailed(f"{func} failed: {' '.join(str(e).split())[:200]}") from e
    return out


def _group_ranks(args: tuple) -> tuple[int, ...] | None:
    """The global ranks of the process group a c10d op runs in (its ``ProcessGroup`` argument), or None.

    NB: c10d ops take the group as a TorchScript object; ``ProcessGroup.unbox`` (torch 2.13) gives it back.
    """
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return tuple(torch.distributed.get_process_group_ranks(torch.distributed.ProcessGroup.unbox(a)))
            except Exception:  # noqa: BLE001 - not a group (a Work, a reduce op), or an API that moved
                continue
    return None


class _CollectiveMode(_OpStatsMode):
    """``_OpStatsMode`` that waits on every collective, so its output statistic is the reduced value.

    NB: the wait only moves it earlier: FSDP2 waits on the same work before it reads the buffer.
    """

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.in_collective = False
        self.override = _Waits(self, self.override)
        self.numels: dict[int, tuple[bool, int]] = {}  # op index of a collective -> (an all-reduce?, largest numel)
        self.groups: dict[int, tuple[int, ...]] = {}  # op index of a collective -> its group's global ranks
        self.fsdp_ops: set[int] = set()  # ops FSDP2 ran in its own hooks (casts, copies of shards, padding)
        self._regions: list[bool] = []  # the open record_function regions: FSDP2's own or not

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # FSDP2 names every hook's work with torch.profiler.record_function("FSDP::..."): its enter and exit
        # are ops here, so what runs between them is FSDP's plumbing, never the model's
        if func.namespace == "profiler":
            if "enter" in func.__name__:
                name = args[0] if args and isinstance(args[0], str) else ""
                self._regions.append(name.startswith(_HOOK_REGIONS) or (bool(self._regions) and self._regions[-1]))
            elif "exit" in func.__name__ and self._regions:
                self._regions.pop()
        elif self._regions and self._regions[-1]:
            self.fsdp_ops.add(len(self.records))
        self.in_collective = is_collective(func.namespace)
        if self.in_collective:
            tensors = [a for a in _flat(args) if isinstance(a, torch.Tensor)]
            # NB: FSDP2 fills the buffer it reduces through a view, by an op that does not bump the version
            # counter: what an earlier op recorded of that memory is stale, so the inputs are measured here
            for t in tensors:
                self._producers.pop(t, None)
            self.numels[len(self.records)] = ("allreduce" in func.__name__,
                                              max((t.numel() for t in tensors), default=0))
            ranks = _group_ranks(args)
            if ranks is not None:
                self.groups[len(self.records)] = ranks
        return super().__torch_dispatch__(func, types, args, kwargs)


@dataclass
class ShardedContext(ReplayContext):
    """A rank's ``ReplayContext``: each run builds the model sharded as recorded and loads this rank's shards."""

    dcp_dir: Path | None = None
    metadata: Any = None                         # the DCP .metadata, read through the allow-list
    modules: tuple = ()                          # schema: fsdp["modules"], outermost first
    reduce_override: str | None = None           # a fix's reduce_dtype ("float32")
    # what the reduce_fp32 fix (fixes/_reduce.py) changes, in the user's terms
    reduce_fp32_title: ClassVar[str] = "reduce_dtype=torch.float32 in every MixedPrecisionPolicy"
    # (an all-reduce?, a module's flat collective numel) -> its path
    _flat_sizes: dict = field(default_factory=dict, repr=False)
    mesh: tuple | None = None  # HSDP: the recorded 2-D mesh's (shape, dim names); None: 1-D over every rank
    _device_mesh: Any = field(default=None, repr=False)  # the DeviceMesh built from `mesh`, once (collective)
    built_on_meta: bool = False  # the model was built on the meta device: no rank ever held it whole
    follow: Any = None  # lockstep.Follow while the one-process pipeline runs on every rank; None: each its own

    def build_model(self, precision: str | None = None) -> torch.nn.Module:
        """A fresh sharded model with this rank's shards, for a run in `precision` (None: as stored, FP32)."""
        if self.follow is not None:
            self.follow.begin(precision)
        self._model = None
        gc.collect()  # NB: the previous run's shards and buffers go before the next model is built
        model = self._make_meta()
        if model is None:  # NB: the whole model exists on this rank until fully_shard has split it
            model = self.make()
            self._shard(model, precision)
        else:
            self._shard(model, precision)
            model.to_empty(device=self.device)  # only this rank's shards are ever allocated
        self._load_shards(model)
        model.train(self.train_mode)
        self._model = model
        return model

    def _make_meta(self) -> torch.nn.Module | None:
        """The model built on the meta device (no memory), or None where that cannot stand in for it.

        Every entry of the model is then loaded from the DCP directory, so nothing the factory computed
        is lost, except non-persistent buffers (a rotary ``inv_freq``, a causal mask), which no checkpoint
        holds: a model with one is built for real, as is one whose factory fails on meta tensors or puts
        tensors on a device of its own.
        """
        try:
            with torch.device("meta"), torch.random.fork_rng():
                model = self.make()
        except Exception:  # noqa: BLE001 - a factory that needs real tensors: built for real instead
            return None
        tensors = list(model.parameters()) + list(model.buffers())
        saved = set(model.state_dict())
        if not all(t.is_meta for t in tensors) or any(n not in saved for n, _ in model.named_buffers()):
            return None
        self.built_on_meta = True
        return model

    def before_micro_batch(self, model: torch.nn.Module, last: bool) -> None:
        """The gradients reduced once, after the last micro-batch: ``set_requires_gradient_sync(last)``, as
        FSDP2 loops accumulate (NB: the snapshot does not say whether training reduced after every one)."""
        if self.micro is not None:
            model.set_requires_gradient_sync(last)

    def finish_run(self, trace: RunTrace) -> RunTrace:
        """This rank's trace; in lockstep, the culprit rank's with every rank's finiteness (``lockstep.Follow``)."""
        return trace if self.follow is None else self.follow.finish(trace, self.fsdp_ops())

    def stats_mode(self, **kwargs: Any) -> _OpStatsMode:
        self.last_mode = _CollectiveMode(**kwargs)
        return self.last_mode

    def fsdp_ops(self) -> set[int]:
        """Op indices of the last run that FSDP2 ran in its own hooks (``_CollectiveMode.fsdp_ops``)."""
        mode = getattr(self, "last_mode", None)
        return set() if mode is None else set(mode.fsdp_ops)

    def collective_modules(self) -> dict[int, str]:
        """Op index of each collective of the last run -> the sharded module whose parameters it moved.

        A module's all-gather output and reduce-scatter input hold its shard group's padded shards of its
        parameters, one flat buffer, and HSDP's all-reduce across replicas this rank's padded shards: matched
        by size (FSDP2 runs its reduce-scatter in autograd's hooks, where no module is on the stack).
        """
        sizes = self._flat_sizes
        mode = getattr(self, "last_mode", None)
        if mode is None:
            return {}
        return {i: sizes[n] for i, n in mode.numels.items() if n in sizes}

    def collective_groups(self) -> dict[int, tuple[int, ...]]:
        """Op index of each collective of the last run -> the global ranks of the group it ran in (HSDP: a shard
        group's reduce-scatter, a replica group's all-reduce)."""
        mode = getattr(self, "last_mode", None)
        return {} if mode is None else dict(mode.groups)

    def collective_sources(self) -> dict[int, int]:
        """Op index of a collective -> the op whose input is the reduction's input: none under FSDP2 (its
        reduce-scatter's own input is the gradient in ``reduce_dtype``)."""
        return {}

    def grads(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """This rank's shards of the gradients (``to_local()``), by parameter name."""
        out = {}
        for n, p in model.named_parameters():
            g = p.grad
            if g is not None:
                g = g.to_local() if callable(getattr(g, "to_local", None)) else g
                if g.numel() > 0:
                    out[n] = g
        return out

    def _policy(self, recorded: Mapping | None, precision: str | None):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if precision is None or precision == "float32":
            return MixedPrecisionPolicy()  # the reference: FP32 compute, FP32 reductions
        recorded = recorded or {}
        names = {k: recorded.get(k) for k in ("param_dtype", "reduce_dtype", "output_dtype")}
        if self.reduce_override is not None:
            names["reduce_dtype"] = self.reduce_override
        if names["param_dtype"] is not None and self.mode.kind == "fsdp_param_dtype":
            names["param_dtype"] = precision  # --dtypes: the other low precision, in place of the recorded one
        try:
            dtypes = {k: None if v is None else schema.dtype_from_name(v) for k, v in names.items()}
        except (TypeError, ValueError) as e:
            raise BadInputError(f"snapshot fsdp mp_policy {names} names no dtype"[:300], path=self.path,
                                fix="re-record the run") from e
        return MixedPrecisionPolicy(**dtypes)

    def _shard(self, model: torch.nn.Module, precision: str | None) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self._mesh()
        for entry in reversed(self.modules):  # children before their parents, as fully_shard needs
            name = entry.get("path") or ""
            try:
                module = model.get_submodule(name) if name else model
            except AttributeError as e:
                raise BadInputError(f"the snapshot's sharded module {name!r} is not in the model the factory "
                                    f"{self.factory_ref!r} builds"[:300], path=self.path,
                                    fix="pass the factory that built this model with --factory") from e
            fully_shard(module, mesh=mesh, mp_policy=self._policy(entry.get("mp_policy"), precision))
            for key in _flat_sizes(module):  # NB: two modules of one size: the inner one is named
                self._flat_sizes.setdefault(key, name or "<root>")
            factor = entry.get("gradient_divide_factor")
            if factor is not None:
                module.set_gradient_divide_factor(float(factor))
                if torch.distributed.get_backend() == "gloo":
                    # NB: gloo has no PREMUL_SUM, which FSDP2 uses for a custom factor in FP32/BF16: a sum and
                    # a division after it, as FSDP2 does for FP16, is the same reduction
                    module.set_force_sum_reduction_for_comms(True)

    def _mesh(self) -> Any:
        """The recorded HSDP mesh, built once on every rank (``init_device_mesh`` is collective); None: 1-D."""
        if self.mesh is None:
            return None
        if self._device_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            shape, names = self.mesh
            self._device_mesh = init_device_mesh(self.device.type, tuple(shape),
                                                 mesh_dim_names=None if names is None else tuple(names))
        return self._device_mesh

    def _load_shards(self, model: torch.nn.Module) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint._traverse import set_element
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        md = self.metadata

        class _Reader(FileSystemReader):
            def read_metadata(self, *args: Any, **kwargs: Any):
                return md  # already read through the allow-list (load.dcp.read_dcp_metadata)

        class _Planner(DefaultLoadPlanner):
            def load_bytes(self, read_item, value):  # the stock planner loads these with weights_only=False
                obj, fqn = torch.load(value, weights_only=True), read_item.dest_index.fqn
                if self.flatten_state_dict:
                    set_element(self.original_state_dict, self.mappings[fqn], obj)
                else:
                    self.state_dict[fqn] = obj

        state = get_model_state_dict(model)
        missing = sorted(k for k in state if f"model.{k}" not in md.state_dict_metadata)
        if missing:
            raise BadInputError(f"the DCP checkpoint lacks {len(missing)} of the model's entries ({missing[0]}, ...)"
                                [:300], path=self.dcp_dir, fix="pass the factory that built this model with --factory")
        try:
            dcp.load({"model": state}, storage_reader=_Reader(str(self.dcp_dir)), planner=_Planner())
        except Exception as e:  # noqa: BLE001 - a corrupt data file fails inside torch in many ways
            raise BadInputError(f"this rank's shards cannot be read from the DCP checkpoint ({type(e).__name__}: "
                                f"{' '.join(str(e).split())[:160]})", path=self.dcp_dir,
                                fix="the directory is damaged, truncated or foreign; re-record with sync_failures=True"
                                ) from e
        set_model_state_dict(model, state)


def _flat_sizes(module: torch.nn.Module) -> list[tuple[bool, int]]:
    """The module's collectives' buffer sizes, ``(an all-reduce?, numel)``: the shard group's padded shards of its
    own sharded parameters (all-gather, reduce-scatter) and, under HSDP, this rank's (the all-reduce across replicas).

    NB: reads FSDP2's private ``FSDPParamGroup.fsdp_params`` and ``mesh_info`` (torch 2.13); none when they moved.
    """
    try:
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:
            return []
        local = sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params)
        info = group.mesh_info
        sizes = [(False, int(info.shard_mesh_size) * local)]
        if getattr(info, "replicate_mesh_size", 1) > 1:
            sizes.append((True, local))
        return sizes if local else []
    except Exception:  # noqa: BLE001 - a private API that moved: the collectives keep autograd's label
        return []


def bad_shards(model: torch.nn.Module) -> list[str]:
    """``param:NAME`` / ``buffer:NAME`` of this rank's non-finite local shards (buffers whole)."""
    bad = []
    for kind, items in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in items:
            local = t.to_local() if callable(getattr(t, "to_local", None)) else t
            if local.is_floating_point() and local.numel() and not bool(torch.isfinite(local).all()):
                bad.append(f"{kind}:{name}")
    return bad

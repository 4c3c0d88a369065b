"""The Recorder's FP8 statistics: every N-th step, each FP8 module's input, weight and grad_output casts.

A model converted for FP8 training (torchao ``Float8Linear``, an MXFP8 training weight) casts three operands per
Linear per step, each for the two GEMMs that read it (``schema.FP8_USES``): input for the forward and the weight
gradient, weight for the forward and the input gradient, grad_output for the input and the weight gradient. On
every ``fp8_every``-th step, ``Fp8Watch`` puts a forward hook on each FP8 module (its input and weight) and a
tensor hook on its output (grad_output), and counts each cast with ``recorders.fp8.cast_counts`` in the format,
granularity and axis that GEMM casts it with (``describe_fp8``'s ``uses``; ``_casts``: rowwise and MX scales run
along the reduction dim of each GEMM, so the second cast of a rowwise operand is scaled across the tokens, and a
tensorwise second cast in the first one's format, the same counts, is left out): amax, scale, saturated (before
the clamp), flushed, subnormal. The counts stay on the device; ``take`` hands them to the step's one host
transfer (``_stats.StepStats._record``), ``record`` turns the host values into ``schema.FP8_COLUMNS`` rows and
fires the trigger: a cast whose flushed fraction passes ``schema.FP8_FLUSH_LIMIT`` or whose saturated fraction
passes ``schema.FP8_SATURATE_LIMIT`` makes the step an ``fp8`` snapshot (edge-triggered per module, role and use,
at most ``MAX_SNAPSHOTS`` per run). Other steps register no hook and pay nothing.

NB: the hooks see the operands the module is given; torchao re-casts its input to the autocast dtype first, which
changes no count that matters here (flushing and saturation are set by the scale, not by BF16 rounding).
Sharded (FSDP2) weights are measured on this rank's shard. Transformer Engine modules (GPU only) keep their own
FP8 state, ``fp8_meta`` (amax history and scale per GEMM operand): ``te_state`` copies it into every snapshot.

Example (a real run of the aligned SwiGLU model in tests/recorders/test_fp8_watch.py, torchao tensorwise)::

    >>> rec = Recorder(run_dir, model, fp8_every=1)   # doctest: +SKIP
    >>> torch.load(rec.snapshots[0], weights_only=True)["fp8"]["fired"]   # doctest: +SKIP
    {'module': 'block.mlp.w2', 'role': 'input', 'use': 'forward', 'call': 0, 'format': 'e4m3',
     'granularity': 'tensorwise', 'numel': 4096, 'nonzero': 4034, 'amax': 19999.92, 'saturated': 0, 'flushed': 3950,
     'subnormal': 82,
     'scale_min': 0.0224, 'scale_max': 0.0224, 'flushed_frac': 0.9792, 'saturated_frac': 0.0, 'subnormal_frac': 0.02}
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from . import schema
from .compiled import clean_name, unwrap
from .fp8 import cast_counts
from .fp8_recipe import describe_fp8, fp8_modules

__all__ = ["Fp8Watch", "MAX_SNAPSHOTS", "te_state"]

MAX_SNAPSHOTS = 2  # fp8 snapshots per run and rank, apart from max_snapshots: an FP8 cast is no training failure
_TE_PREFIX = "transformer_engine.pytorch"
_TE_COLUMNS = {"scaling_fwd": ("input", "weight", "output"), "scaling_bwd": ("grad_output", "grad_input")}
_N = 8  # the values cast_counts returns per cast


def _te_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Transformer Engine modules by name: recognised by their class's module, never imported."""
    return {clean_name(n): m for n, m in unwrap(model).named_modules()
            if type(m).__module__.startswith(_TE_PREFIX) and isinstance(getattr(m, "fp8_meta", None), dict)}


def te_state(modules: dict[str, torch.nn.Module]) -> dict | None:
    """Each Transformer Engine module's ``fp8_meta`` (amax history, scale, scale_inv per GEMM operand), on the CPU.

    Duck-typed: TE's ``FP8TensorMeta`` under ``fp8_meta["scaling_fwd"]`` / ``["scaling_bwd"]``; its columns are
    TE's ``FP8FwdTensors`` (input, weight, output per GEMM) and ``FP8BwdTensors`` (grad_output, grad_input).
    """
    out = {}
    for name, mod in modules.items():
        meta = mod.fp8_meta
        entry: dict[str, Any] = {"class": f"{type(mod).__module__}.{type(mod).__qualname__}",
                                 "recipe": None if meta.get("recipe") is None else repr(meta.get("recipe"))[:500]}
        for key, roles in _TE_COLUMNS.items():
            tm = meta.get(key)
            vals = {a: t.detach().to("cpu", copy=True) for a in ("amax_history", "scale", "scale_inv")
                    if isinstance(t := getattr(tm, a, None), torch.Tensor)}
            if vals:
                hist = vals.get("amax_history")
                cols = hist.shape[-1] if hist is not None and hist.dim() else vals.get("scale", torch.empty(0)).numel()
                vals["columns"] = [f"gemm{i // len(roles) + 1}_{roles[i % len(roles)]}" for i in range(cols)]
                entry[key] = vals
        out[name] = entry
    return out or None


def _casts(spec: dict | None) -> list[tuple[str, dict, int]]:
    """``(use, cast, dim)`` of each cast of one operand role (``describe_fp8``'s role entry), in the GEMMs' order.

    `dim` is the axis of the operand, flattened to 2-D around its last dim, that a rowwise or MX scale runs along
    (torchao 0.18: ``float8_linear.py``'s ``axiswise_dim``, ``mxfp8_linear.py``'s ``to_mx`` of a transposed copy):
    the first use reduces over the last dim (input and grad_output per token, weight per output feature, along
    ``in_features``), the second over dim 0 (input and grad_output per feature across the tokens for the weight
    gradient; weight per input feature, along ``out_features``, for the input gradient). A second use cast like
    the first under one tensorwise scale gives the same counts: it is left out. A role entry without ``uses``
    (a recipe of format 8) is its first use alone.
    """
    if not spec:
        return []
    uses = spec.get("uses") or {None: spec}
    out = []
    for k, (use, cast) in enumerate(uses.items()):
        if cast.get("scaling") == "disabled":
            continue  # this GEMM reads the operand in high precision
        if k and cast.get("granularity") == "tensorwise" and any(
                cast.get("format") == c["format"] and c["granularity"] == "tensorwise" for _, c, _ in out):
            continue
        out.append((use, cast, -1 if k == 0 else 0))
    return out


class Fp8Watch:
    """The FP8 casts of sampled steps (module docstring). Inert (``on`` False) without FP8 modules or `every`."""

    def __init__(self, model: torch.nn.Module, every: int | None, device: torch.device):
        self.recipe = describe_fp8(model)
        found = fp8_modules(model)
        configs = self.recipe["configs"] if self.recipe else []
        self.targets = [(name, m, configs[self.recipe["modules"][name]]["roles"])
                        for n, m in unwrap(model).named_modules() if (name := clean_name(n)) in found]
        self.te = _te_modules(model)
        self.every = every
        self.device = device
        self.on = every is not None and bool(self.targets)
        self.fired = 0
        self.casts: list[dict] | None = None  # this step's casts, once recorded (None: not measured)
        self.last_fired: dict | None = None  # the cast that fired this step's fp8 snapshot
        self.error: BaseException | None = None  # raised by a hook: re-raised by take(), where the recorder stops
        self._above: set[tuple[str, str, str]] = set()  # (module, role, use) above the limits at the last measure
        self._handles: list = []
        self._pending: list[torch.Tensor] = []
        self._labels: list[tuple] = []
        self._calls: dict[str, int] = {}
        self._open = False
        self._rows: list[dict] = []

    def settings(self) -> dict | None:
        """meta.json's ``fp8`` (``schema.FP8_SETTINGS``); None when the model holds no FP8 module."""
        if not self.targets and not self.te:
            return None
        return {"every": self.every, "flush_limit": schema.FP8_FLUSH_LIMIT,
                "saturate_limit": schema.FP8_SATURATE_LIMIT, "max_snapshots": MAX_SNAPSHOTS,
                "modules": [n for n, _, _ in self.targets], "transformer_engine": sorted(self.te)}

    # ------------------------------------------------------------------ the step
    def begin(self, step: int) -> None:
        """Start `step`: hooks on the FP8 modules when it is an ``every``-th step, none otherwise."""
        self.remove()
        self.casts = self.last_fired = None
        # NB: always: a step that raised before end_step leaves its counts and its output hooks behind
        self._pending, self._labels, self._calls, self._open = [], [], {}, False
        if not self.on or step % self.every:
            return
        self._open = True
        for name, mod, roles in self.targets:
            self._handles.append(mod.register_forward_hook(functools.partial(self._forward, name, roles)))

    def _forward(self, name: str, roles: dict, mod: torch.nn.Module, args: tuple, out: Any) -> None:
        try:
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            if args and isinstance(args[0], torch.Tensor):
                self._add(name, "input", call, args[0], roles)
            if isinstance(getattr(mod, "weight", None), torch.Tensor):
                self._add(name, "weight", call, mod.weight, roles)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(functools.partial(self._backward, name, roles, call))
        except Exception as e:  # noqa: BLE001 - never take the forward down: the recorder stops at end_step
            self._fail(e)

    def _backward(self, name: str, roles: dict, call: int, grad: torch.Tensor) -> None:
        try:
            if self._open:
                self._add(name, "grad_output", call, grad, roles)
        except Exception as e:  # noqa: BLE001 - never take the backward down
            self._fail(e)

    def _add(self, name: str, role: str, call: int, x: torch.Tensor, roles: dict) -> None:
        """Count each cast of operand `x`: one per GEMM that reads it (``_casts``)."""
        casts = _casts(roles.get(role))
        if not casts or x.numel() == 0:
            return  # this operand stays in high precision under the recipe
        to_local = getattr(x, "to_local", None)  # an FSDP2 shard: this rank's, no collective
        x = to_local() if callable(to_local) else x
        if isinstance(getattr(x, "_data", None), torch.Tensor):  # torchao's training weight wrapper: its plain data
            x = x._data
        with torch.no_grad():
            flat = x.detach().reshape(-1, x.shape[-1]) if x.dim() else x.detach().reshape(1, 1)
            for use, spec, dim in casts:
                self._pending.append(cast_counts(flat, spec["format"], spec["granularity"], dim).to(self.device))
                self._labels.append((name, role, use, call, spec["format"], spec["granularity"]))

    def _fail(self, e: BaseException) -> None:
        self.error = self.error or e
        self.on = False
        self._open = False

    def remove(self) -> None:
        """Remove this step's hooks (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def take(self) -> torch.Tensor | None:
        """This step's counts as one float64 device tensor (8 per cast, ``cast_counts``'s), or None; hooks off."""
        self.remove()
        self._open = False
        if self.error is not None:
            raise self.error
        if not self._pending:
            return None
        return torch.cat(self._pending)

    def record(self, step: int, rank: int, values: list[float], free: bool = True) -> dict | None:
        """The host values of ``take()``'s tensor -> trace rows; returns the cast that fires an fp8 snapshot, or None.
        `free`: no other reason snapshots this step (else the cast that would fire is kept as evidence only and
        spends none of the fp8 snapshots)."""
        casts, over, now = [], [], set()
        for i, (name, role, use, call, fmt, gran) in enumerate(self._labels):
            v = values[i * _N:(i + 1) * _N]
            numel, nonzero, sat, flushed, sub = (int(v[k]) for k in (0, 1, 3, 4, 5))
            use = use or schema.FP8_FIRST_USE[role]
            cast = {"module": name, "role": role, "use": use, "call": call, "format": fmt, "granularity": gran,
                    "numel": numel, "nonzero": nonzero, "amax": v[2], "saturated": sat, "flushed": flushed,
                    "subnormal": sub, "scale_min": v[6], "scale_max": v[7],
                    "flushed_frac": flushed / nonzero if nonzero else 0.0,
                    "saturated_frac": sat / numel if numel else 0.0, "subnormal_frac": sub / numel if numel else 0.0}
            casts.append(cast)
            self._rows.append({"step": step, "rank": rank, **{k: cast[k] for k in schema.FP8_COLUMNS if k in cast}})
            if cast["flushed_frac"] > schema.FP8_FLUSH_LIMIT or cast["saturated_frac"] > schema.FP8_SATURATE_LIMIT:
                now.add((name, role, use))
                if (name, role, use) not in self._above:  # edge-triggered: a stretch above the limits fires once
                    over.append(cast)
        self._above = now
        self.casts = casts
        self._labels, self._pending = [], []
        if not over or (free and self.fired >= MAX_SNAPSHOTS):
            return None
        self.last_fired = max(over, key=lambda c: (c["flushed_frac"], c["saturated_frac"]))
        if not free:
            return None
        self.fired += 1
        return self.last_fired

    # ------------------------------------------------------------------ what is written
    def entry(self) -> dict | None:
        """A snapshot's ``fp8`` (``schema.FP8_KEYS``); None when the model holds no FP8 module."""
        if not self.targets and not self.te:
            return None
        return {"casts": self.casts, "fired": self.last_fired, "flush_limit": schema.FP8_FLUSH_LIMIT,
                "saturate_limit": schema.FP8_SATURATE_LIMIT,
                "transformer_engine": te_state(self.te) if self.te else None}

    def drain(self):
        """The rows recorded since the last drain, as a ``schema.FP8_COLUMNS`` frame, or None."""
        if not self._rows:
            return None
        import polars as pl

        rows, self._rows = self._rows, []
        return pl.DataFrame(rows, schema=schema.FP8_COLUMNS)

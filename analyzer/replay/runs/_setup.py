"""Replay set-up: the rebuilt model's context, the precisions and loss scale to replay, the broken inputs.

What ``Replay`` reads from a snapshot before any run: the model factory and loss function resolved
under the import rule (``context``), the AMP dtype training computed in (``amp_dtype``, FP32 when the
recorder saw autocast off: ``autocast_was_off``), the precisions (``precisions``) and loss scale
(``loss_scale``), and which inputs are already NaN/Inf or additive masks (``scan_inputs``).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from recorders import schema

from ...errors import AnalyzerError, BadInputError, FactoryError
from ...load import Snapshot, recorded_cwd, resolve_ref
from ...load.run_dir import read_meta
from ._precision import PrecisionMode
from ._runs import ReplayContext
from ..result.trace import RunTrace

__all__ = ["context", "autocast_was_off", "amp_dtype", "precisions", "loss_scale", "scan_inputs", "device_note",
           "float_or_none"]

_ALLOWED = ("float32", "float16", "bfloat16")


def context(path: str, snap: Snapshot, device: str, factory: str | None, loss_fn: str | None,
             roots: tuple[str, ...], *, state: dict | None = None) -> ReplayContext:
    factory_ref = factory or snap.factory
    loss_ref = loss_fn or snap.loss_fn
    if not factory_ref:
        raise FactoryError("snapshot names no model factory", path=path, fix="pass --factory pkg.module:function")
    if not loss_ref:
        raise FactoryError("snapshot names no loss function", path=path, fix="pass --loss-fn pkg.module:function")
    cwd = recorded_cwd(snap)
    factory_fn = resolve_ref(factory_ref, what="factory", option="--factory", roots=roots, explicit=bool(factory),
                             recorded=cwd)
    loss_callable = resolve_ref(loss_ref, what="loss_fn", option="--loss-fn", roots=roots, explicit=bool(loss_fn),
                                recorded=cwd)
    # factory_kwargs, model_state and rng were validated by load_snapshot (load/_validate.py)
    if device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif device in ("cpu", "cuda"):
        if device == "cuda" and not torch.cuda.is_available():
            raise AnalyzerError("--device cuda was asked for but CUDA is not available here", fix="use --device cpu")
        dev = torch.device(device)
    else:
        raise AnalyzerError(f"unknown device {device!r}", fix="use --device auto, cpu or cuda")
    recorded = snap.device_type
    return ReplayContext(
        path=path, factory=factory_fn, factory_ref=factory_ref, factory_kwargs=snap.factory_kwargs or {},
        loss_fn=loss_callable, loss_ref=loss_ref, model_state=snap.model_state if state is None else state,
        batch=snap.batch,
        rng=snap.rng, train_mode=snap.train_mode, device=dev, sdpa=snap.sdpa,
        emulate_cuda=(recorded == "cuda" and dev.type == "cpu"), mode=PrecisionMode(),
        micro=getattr(snap, "micro_batches", None),
    )


def autocast_was_off(path: str) -> dict | None:
    """What the recorder saw of autocast in the run the snapshot `path` belongs to, when it saw it
    off during training's forward (meta.json's ``autocast``, ``enabled: false``); None otherwise,
    and for a snapshot outside a run directory or beside an unreadable meta.json."""
    meta = Path(path).parent.parent / schema.META_FILE
    if not meta.is_file():
        return None
    try:
        seen = read_meta(meta).get("autocast")
    except BadInputError:  # the report names a damaged meta.json; the snapshot replays on its own word
        return None
    return seen if isinstance(seen, dict) and seen.get("enabled") is False else None


def amp_dtype(path: str, snap: Snapshot, autocast_off: dict | None) -> str | None:
    """The precision training computed in: the snapshot's amp_dtype, None when `autocast_off`
    (``autocast_was_off``) says the forward ran without autocast."""
    raw = snap.amp_dtype
    if raw is None or autocast_off is not None:  # trained in FP32: replay the step that ran
        return None
    try:
        name = schema.dtype_name(schema.dtype_from_name(raw))
    except ValueError as e:
        raise BadInputError(f"snapshot amp_dtype {raw!r} is not a dtype", path=path, fix="re-record the run") from e
    return None if name == "float32" else name


def precisions(amp: str | None, dtypes: list[str] | None) -> list[str]:
    wanted = ["float32"] + ([amp] if amp else [])
    for d in dtypes or []:
        try:
            name = schema.dtype_name(schema.dtype_from_name(d))
        except ValueError:
            name = None
        if name not in _ALLOWED:
            raise AnalyzerError(f"cannot replay in dtype {d!r}", fix="use --dtypes with fp32, fp16 and/or bf16")
        if name not in wanted:
            wanted.append(name)
    return wanted


def loss_scale(path: str, snap: Snapshot) -> float:
    scale = snap.scale
    if scale is None:
        return 1.0
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise BadInputError(f"snapshot scale {scale!r} is not a positive finite number", path=path,
                            fix="re-record the run")
    return float(scale)


def scan_inputs(ctx: ReplayContext) -> tuple[list[str], list[str]]:
    """Names of parameters, buffers and batch leaves that are already NaN/Inf, and of the masks.

    A buffer or batch leaf holding only 0 and -inf is an additive mask (a causal mask buffer,
    ``nn.Transformer.generate_square_subsequent_mask`` passed in the batch): its -inf is written
    on purpose, an input to the story like an in-step ``masked_fill(-inf)``, not a broken input.
    """
    model = ctx.build_model()
    params = {n for n, _ in model.named_parameters()}
    buffers = {n for n, _ in model.named_buffers()}
    bad, masks = [], []
    for name, t in ctx.model_state.items():
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            kind = "param" if name in params else ("buffer" if name in buffers else "state")
            (masks if kind == "buffer" and _is_mask(t) else bad).append(f"{kind}:{name}")
    for p, t in _bad_leaves(ctx.batch, ""):
        (masks if _is_mask(t) else bad).append(f"batch:{p}")
    return bad, masks


def _is_mask(t: torch.Tensor) -> bool:
    """Every entry is 0 or -inf: an additive mask (a non-finite tensor, so at least one -inf)."""
    return bool(((t == 0) | (t == float("-inf"))).all())


def _bad_leaves(obj: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        ok = not obj.is_floating_point() or obj.numel() == 0 or bool(torch.isfinite(obj).all())
        return [] if ok else [(prefix or "<tensor>", obj)]
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return []
    out = []
    for k, v in items:
        out += _bad_leaves(v, f"{prefix}.{k}" if prefix else str(k))
    return out


def device_note(recorded: str, ctx: ReplayContext, amp: str | None, runs: dict[str, RunTrace]) -> str | None:
    if recorded == ctx.device.type:
        return None
    note = f"recorded on {recorded}, replayed on {ctx.device.type}"
    if ctx.emulate_cuda and amp:
        n = max((r.emulated_cuda_ops for r in runs.values()), default=0)
        note += (f"; CUDA autocast's FP32 policy was emulated on CPU (inputs of softmax, log_softmax, "
                 f"layer_norm, exp, log, sum... upcast to FP32: {n} calls)")
    elif ctx.device.type == "cuda" and amp:
        note += "; CUDA autocast runs softmax/log_softmax/layer_norm in FP32 where CPU autocast did not"
    if recorded == "cuda" and ctx.device.type == "cpu":
        note += "; CUDA random streams (dropout masks) cannot be restored on CPU"
    return note


def float_or_none(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

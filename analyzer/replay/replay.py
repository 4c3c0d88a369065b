"""``replay_snapshot``: re-run a failing step in FP32 and FP16/BF16 and name the op that broke it.

Example:
    >>> from analyzer.render import render_replay_text
    >>> from analyzer.replay import replay_snapshot
    >>> result = replay_snapshot("run/snapshots/step00000042-r00000-nonfinite_loss.pt")  # doctest: +SKIP
    >>> result.verdict, result.culprit["op"], result.culprit["module"]  # doctest: +SKIP
    ('overflow', 'aten.bmm', 'attn')
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Any

import torch

from recorders import schema

from ..errors import AnalyzerError, BadInputError, FactoryError
from ..load import Snapshot, load_snapshot, recorded_cwd, resolve_ref, snapshot_roots
from ..load.dcp import load_sharded_state, sibling_snapshot
from . import _advice
from ._origin import align, find_flush, find_origin, op_kind
from ._precision import PrecisionMode, mode_advice, precision_mode
from ._runs import LOW_PRECISION, ReplayContext, RunTrace, run_once
from ._shadow import shadow
from .backends import backend_of, kernel_check
from .records import Culprit, OpRecord
from .result import ReplayResult
from .update import explained_by_update, replay_update, update_applies

__all__ = ["replay_snapshot"]

_ALLOWED = ("float32", "float16", "bfloat16")
_KIND = ("finite", "inf", "nan")


def replay_snapshot(path: str | os.PathLike, *, device: str = "auto", dtypes: list[str] | None = None,
                    factory: str | None = None, loss_fn: str | None = None,
                    progress: bool = False, paths: tuple[str, ...] = (), rank: int | None = None) -> ReplayResult:
    """Replay the snapshot's step per precision and classify the first NaN/Inf-producing op.

    Args:
        path: a snapshot written by the recorder (``RUN_DIR/snapshots/*.pt``), or a ``Snapshot``
            already read (``load.adhoc.load_checkpoint_snapshot``: a checkpoint and a batch).
        device: ``"auto"`` (CUDA when present), ``"cpu"`` or ``"cuda"``.
        dtypes: precisions to replay (``fp32``, ``fp16``, ``bf16``...). FP32 and the run's AMP
            dtype are always replayed.
        factory: override the snapshot's model factory reference (``pkg.mod:function``).
        loss_fn: override the snapshot's loss function reference.
        paths: extra import roots (``--path``) for the snapshot's factory and loss function.
        progress: draw a progress bar on stderr.
        rank: replay this rank's snapshot of the same step instead (``--rank``): the file beside
            `path` with the same step, writer and reason.

    An FSDP2 snapshot (its ``fsdp`` key) is replayed in this one process: the whole model is read
    from its DCP directory (or joined from every rank's shards, ``load.dcp``), rebuilt unsharded,
    and this rank's batch runs with the ``fsdp_param_dtype`` precision mode against FP32.

    Raises:
        BadInputError, VersionError, FactoryError: unreadable snapshot or model code.
    """
    given = path if isinstance(path, Snapshot) else None  # a checkpoint and a batch (load.adhoc), already read
    path = given.path if given is not None else os.fspath(path)
    if rank is not None:
        path = os.fspath(sibling_snapshot(path, rank))
    snap = given if given is not None else load_snapshot(path)
    if update_applies(snap) and (snap.reason == "update" or explained_by_update(path, snap)):
        # the NaN was born in the optimizer step: recompute it, import no model code
        return dataclasses.replace(replay_update(path, snap), checkpoint=getattr(snap, "source", None))
    amp = _amp_dtype(path, snap)
    state = load_sharded_state(path, snap)  # an FSDP snapshot's whole model; None for any other
    state = snap.model_state if state is None else state
    ctx = _context(path, snap, device, factory, loss_fn, paths, state=state)
    fork = [ctx.device.index or 0] if ctx.device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork):  # the caller's RNG is left as it was (a factory may draw)
        params = {n for n, _ in ctx.build_model().named_parameters()}
    mode = ctx.mode = precision_mode(path, snap, amp, state, params)
    precisions = _precisions(mode.dtype, dtypes)  # FP32 and the low precision the run trained in
    scale = _scale(path, snap)
    bar = _Progress(progress, total=len(precisions))
    with torch.random.fork_rng(devices=fork):  # the caller's RNG is left as it was
        nonfinite_inputs, masks = _scan_inputs(ctx)
        # Non-finite buffers are followed through the FP32 run: one the step only writes (a
        # train-mode BatchNorm's running stats, saved after the forward wrote them) is no input.
        watch = [n.split(":", 1)[1] for n in nonfinite_inputs if n.startswith("buffer:")]
        runs: dict[str, RunTrace] = {}
        at_one: dict[str, RunTrace] = {}
        for p in precisions:
            bar.step(f"{p} forward+backward")
            runs[p] = run_once(ctx, p, scale, on_ops=bar.ops, watch=watch if p == "float32" else None)
            if runs[p].forward_finite and not runs[p].grads_finite and scale != 1.0:
                bar.extra(f"{p} at loss scale 1")
                at_one[p] = run_once(ctx, p, 1.0, on_ops=bar.ops)
        read = runs["float32"].buffers_read or set()
        written_only = [f"buffer:{n}" for n in watch if n not in read]
        nonfinite_inputs = [n for n in nonfinite_inputs if n not in written_only]
        bar.extra("diagnosis")
        diag = _diagnose(ctx, runs, at_one, mode.dtype, scale, nonfinite_inputs, on_ops=bar.ops)
        bar.done()
    recorded = snap.device_type
    return ReplayResult(
        verdict=diag["verdict"],
        summary=_advice.summary(diag["verdict"], diag["culprit"], inputs=nonfinite_inputs, scale=scale,
                                recorded_loss=_float_or_none(snap.loss), written_only=written_only,
                                masks=masks, sdpa=diag.get("sdpa")),
        culprit=diag["culprit"],
        runs={p: _run_dict(r, at_one.get(p), diag["origins"].get(p)) for p, r in runs.items()},
        advice=mode_advice(mode, diag["verdict"], diag["culprit"],
                           _advice.advice(diag["verdict"], diag["culprit"], inputs=nonfinite_inputs, scale=scale,
                                          masks=masks, sdpa=diag.get("sdpa"),
                                          tried={p: r.finite for p, r in runs.items()},
                                          scaler=snap.has_scaler,
                                          mode=mode.kind, low=mode.dtype)),
        snapshot=path, step=snap.step, reason=snap.reason,
        device=str(ctx.device.type), recorded_device=str(recorded),
        device_note=_device_note(str(recorded), ctx, amp, runs),
        amp_dtype=amp, scale=scale, recorded_loss=_float_or_none(snap.loss),
        nonfinite_inputs=nonfinite_inputs, written_only_buffers=written_only, mask_inputs=masks,
        hidden_nonfinite=diag.get("hidden"), literal_nonfinite=diag.get("literal"),
        underflow_at=diag.get("underflow_at"),
        context_ops=diag.get("context", []),
        sdpa_backend=_sdpa_backend(diag, runs), backends=(diag.get("sdpa") or {}).get("backends"),
        traces=runs, culprit_trace=diag.get("trace"), context=ctx,
        precision_mode=mode.kind, precision_dtype=mode.dtype, precision_note=mode.describe(),
        exception=snap.exception, scaler_state=snap.scaler_state,
        checkpoint=getattr(snap, "source", None),
    )


def _sdpa_backend(diag: dict, runs: dict[str, RunTrace]) -> str | None:
    """The SDPA backend the culprit's call ran, else the one the trained precision's run ran."""
    ran = (diag.get("sdpa") or {}).get("backend")
    trace = diag.get("trace") or list(runs.values())[min(1, len(runs) - 1)]
    return ran or backend_of(trace.sdpa_calls)


def _float_or_none(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


# -- setup ---------------------------------------------------------------------------------------
def _context(path: str, snap: Snapshot, device: str, factory: str | None, loss_fn: str | None,
             paths: tuple[str, ...] = (), *, mode: PrecisionMode | None = None,
             state: dict | None = None) -> ReplayContext:
    factory_ref = factory or snap.factory
    loss_ref = loss_fn or snap.loss_fn
    if not factory_ref:
        raise FactoryError("snapshot names no model factory", path=path, fix="pass --factory pkg.module:function")
    if not loss_ref:
        raise FactoryError("snapshot names no loss function", path=path, fix="pass --loss-fn pkg.module:function")
    roots = snapshot_roots(snap, paths)  # --path roots (the import rule); the recorded cwd only names --path
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
        emulate_cuda=(recorded == "cuda" and dev.type == "cpu"), mode=mode or PrecisionMode(),
    )


def _amp_dtype(path: str, snap: Snapshot) -> str | None:
    raw = snap.amp_dtype
    if raw is None:
        return None
    try:
        name = schema.dtype_name(schema.dtype_from_name(raw))
    except ValueError as e:
        raise BadInputError(f"snapshot amp_dtype {raw!r} is not a dtype", path=path, fix="re-record the run") from e
    return None if name == "float32" else name


def _precisions(amp: str | None, dtypes: list[str] | None) -> list[str]:
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


def _scale(path: str, snap: Snapshot) -> float:
    scale = snap.scale
    if scale is None:
        return 1.0
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise BadInputError(f"snapshot scale {scale!r} is not a positive finite number", path=path,
                            fix="re-record the run")
    return float(scale)


def _scan_inputs(ctx: ReplayContext) -> tuple[list[str], list[str]]:
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


# -- diagnosis -----------------------------------------------------------------------------------
def _diagnose(ctx, runs, at_one, amp, scale, nonfinite_inputs, on_ops=None) -> dict:
    fp32 = runs["float32"]
    origins = {p: find_origin(at_one.get(p) if p in at_one and not at_one[p].finite else r)
               for p, r in runs.items()}
    if nonfinite_inputs:
        run = runs.get(amp) if amp else fp32
        first = next((rec for rec in run.records
                      if any(p is None and run.kind(s) > 0 for s, p in rec.inputs)), None)
        culprit = Culprit(**_op_fields(run, first.index), input=nonfinite_inputs[0]) if first is not None else None
        return {"verdict": "nonfinite_input", "culprit": culprit, "origins": origins,
                "trace": run, "context": _context_ops(run, first.index if first else None)}
    if all(r.finite for r in runs.values()):
        return {"verdict": "healthy", "culprit": None, "origins": origins}
    if not fp32.finite:
        p = "float32"
    else:
        p = amp if amp in runs and not runs[amp].finite else next(q for q, r in runs.items() if not r.finite)
    run = runs[p]
    if run.forward_finite and p in at_one and at_one[p].finite:
        return _finish(ctx, "loss_scale_overflow", run, _checked(ctx, find_origin(run)), origins)
    eff = at_one[p] if p in at_one else run
    o = _checked(ctx, origins[p])
    # Diagnosis pass: the same step again with zero counts and the origin's inputs captured.
    low = run_once(ctx, p, eff.scale, zeros=True, capture=o.index, on_ops=on_ops)
    if len(low.records) != len(eff.records) or low.records[o.index].name != eff.records[o.index].name:
        raise AnalyzerError(
            f"two replays of the same step in {p} ran different ops, so the culprit cannot be pinned",
            path=ctx.path, fix="make the model's forward deterministic (no data-dependent randomness "
            "outside torch's RNG) and replay again")
    rec = low.records[o.index]
    low_dtype = getattr(torch, p) if p in LOW_PRECISION else None
    sh = shadow(rec.name, rec.overload, low.captured, low_dtype)
    if p == "float32":
        verdict, extra = "numerical_bug", {}
    elif rec.namespace not in ("aten", "prims") and any(_dname(d) in LOW_PRECISION for d in rec.in_dtypes):
        verdict, extra = "unregistered_op", {}
    elif sh["float32"] is not None and math.isfinite(sh["float32"]):
        verdict, extra = "overflow", {}
    else:
        ref = run_once(ctx, "float32", eff.scale, zeros=True, on_ops=on_ops)
        flush = find_flush(low, ref, o.index)
        if flush is not None:
            verdict, extra = "underflow", {"underflow_at": _flush_dict(low, ref, flush)}
        else:
            verdict, extra = "numerical_bug", {}
    # An SDPA culprit: the same step under each other attention backend (kernel_specific).
    verdict, sdpa = kernel_check(ctx, verdict, low, rec, p, eff.scale, on_ops=on_ops)
    return {**_finish(ctx, verdict, low, o, origins, shadow_=sh, ref=fp32, **extra), "sdpa": sdpa}


def _checked(ctx, origin):
    if origin is None or origin.index is None:
        raise AnalyzerError("the replay is non-finite but no recorded op produced the NaN/Inf", path=ctx.path,
                            fix="please report this with the snapshot")
    return origin


def _finish(ctx, verdict, run, o, origins, *, shadow_=None, ref=None, underflow_at=None) -> dict:
    found: dict = {"shadow": None if shadow_ is None else {
        "float32": shadow_["float32"], "float64": shadow_["float64"],
        "dtype_max": float(torch.finfo(getattr(torch, run.precision)).max),
        "error": shadow_["error"],
    }}
    if ref is not None and ref is not run:
        j = align(run, ref).get(o.index)
        found["fp32_output_absmax"] = None if j is None else _out_absmax(ref, j)
    literal = _op_record(run, o.literal_index) if o.literal_index is not None else None
    hidden = _op_record(run, o.hidden_index) if o.hidden_index is not None else None
    if underflow_at is not None:
        found["underflow_at"] = underflow_at
    culprit = Culprit(**_op_fields(run, o.index), literal_nonfinite=literal, hidden=hidden, **found)
    return {"verdict": verdict, "culprit": culprit, "origins": origins, "literal": literal,
            "hidden": hidden, "underflow_at": underflow_at, "trace": run,
            "context": _context_ops(run, o.index)}


def _dname(dtype) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _out_absmax(run: RunTrace, i: int) -> float | None:
    vals = [run.absmax[s] for s in run.records[i].outputs]
    return _nan_max(vals)


def _nan_max(vals: list[float]) -> float | None:
    if not vals:
        return None
    if any(math.isnan(v) for v in vals):
        return float("nan")
    return max(vals)


def _op_record(run: RunTrace, i: int) -> OpRecord:
    return OpRecord(**_op_fields(run, i))


def _op_fields(run: RunTrace, i: int) -> dict:
    rec = run.records[i]
    return {
        "op": rec.name, "overload": rec.overload, "module": rec.module, "phase": rec.phase,
        "precision": run.precision, "index": rec.index, "source": rec.source, "node": rec.node,
        "input_dtypes": sorted(_dname(d) for d in rec.in_dtypes), "output_dtype": _dname(rec.out_dtype),
        "input_absmax": _nan_max([run.absmax[s] for s, _ in rec.inputs]),
        "output_absmax": _out_absmax(run, i),
        "output_kind": _KIND[op_kind(run, rec)],
        "custom": rec.namespace not in ("aten", "prims"),
    }


def _flush_dict(low: RunTrace, ref: RunTrace, i: int) -> OpRecord:
    from ._origin import zero_count

    j = align(low, ref).get(i)
    return OpRecord(**_op_fields(low, i), zeros=zero_count(low, low.records[i]),
                    fp32_zeros=None if j is None else zero_count(ref, ref.records[j]))


def _context_ops(run: RunTrace, center: int | None, half: int = 4) -> list[OpRecord]:
    if center is None:
        return []
    lo, hi = max(0, center - half), min(len(run.records), center + half + 1)
    return [_op_record(run, i) for i in range(lo, hi)]


def _run_dict(run: RunTrace, at_one: RunTrace | None, origin) -> dict:
    first = None
    if origin is not None and origin.index is not None:
        src = at_one if at_one is not None and not at_one.finite else run
        if origin.index < len(src.records):
            rec = src.records[origin.index]
            first = {"index": rec.index, "op": rec.name, "module": rec.module, "phase": rec.phase,
                     "source": rec.source}
    out = {
        "finite": run.finite, "loss": run.loss, "loss_dtype": run.loss_dtype,
        "forward_finite": run.forward_finite, "backward_finite": run.grads_finite,
        "grad_absmax": run.grad_absmax, "scale": run.scale, "ops": len(run.records),
        "first_nonfinite": first,
    }
    if at_one is not None:
        out["finite_at_scale_1"] = at_one.finite
    if run.emulated_cuda_ops:
        out["emulated_cuda_fp32_calls"] = run.emulated_cuda_ops
    return out


def _device_note(recorded: str, ctx: ReplayContext, amp: str | None, runs: dict[str, RunTrace]) -> str | None:
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


class _Progress:
    """A one-line progress bar on stderr, only when asked for."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total, self.i, self.label = enabled, total, 0, ""
        self.ops = self._ops if enabled else None

    def _draw(self, label: str, ops: int | None = None) -> None:
        if not self.enabled:
            return
        self.label = label
        width = 20
        filled = int(width * min(self.i, self.total) / max(self.total, 1))
        count = f" {ops} ops" if ops else ""
        sys.stderr.write(f"\rreplay [{'#' * filled}{'.' * (width - filled)}] {self.i}/{self.total} "
                         f"{label + count:<44}")
        sys.stderr.flush()

    def _ops(self, n: int) -> None:
        self._draw(self.label, n)

    def step(self, label: str) -> None:
        self.i += 1
        self._draw(label)

    def extra(self, label: str) -> None:
        self._draw(label)

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()

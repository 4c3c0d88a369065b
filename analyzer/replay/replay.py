"""``Replay``: re-run a failing step in FP32 and FP16/BF16 and name the op that broke it.

A ``Replay`` owns the live state of one snapshot's replay: the loaded snapshot, the model rebuilt
from it and the import roots its code comes from. ``run()`` returns a plain ``ReplayResult``;
``try_fixes(result)`` re-runs the step with each fix on the same rebuilt model.

The flow: load the snapshot -> rebuild the model (``_runs.ReplayContext``) -> one run per
precision (``_runs.run_once``) -> ``_diagnose.diagnose`` -> the verdict's summary and advice
(``verdicts``) -> ``ReplayResult``; the fixes (``fixes``) and ``analyzer.render`` come after.

Example:
    >>> from analyzer.render import render_replay_text
    >>> from analyzer.replay import Replay
    >>> replay = Replay("run/snapshots/step00000042-r00000-nonfinite_loss.pt")  # doctest: +SKIP
    >>> result = replay.run()                                                    # doctest: +SKIP
    >>> result.verdict, result.culprit["op"], result.culprit["module"]           # doctest: +SKIP
    ('overflow', 'aten.bmm', 'attn')
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from recorders import schema

from ..errors import AnalyzerError, BadInputError, FactoryError
from ..load import Snapshot, load_snapshot, recorded_cwd, resolve_ref, snapshot_roots
from ..load.dcp import load_sharded_state, sibling_snapshot
from ..load.run_dir import read_meta
from . import verdicts
from ._accumulate import micro_summary, with_micro_batch
from ._attribution import sources_relative_to
from ._diagnose import diagnose, precision_run, with_roots
from ._bf16 import needs_bf16, with_bf16
from ._magnitude import with_jump
from ._precision import PrecisionMode, precision_mode
from ._compiled_replay import with_compiled
from ._runs import ReplayContext, run_once
from .trace import RunTrace
from .backends import backend_of
from .diagnosis import Diagnosis
from .fixes import Fix, run_fixes
from .result import ReplayResult
from .update import OUTSIDE_NOTE, explained_by_update, replay_update, update_applies, written_outside

__all__ = ["Replay", "replay_snapshot", "try_fixes"]

_ALLOWED = ("float32", "float16", "bfloat16")


class Replay:
    """One snapshot's replay, and the live state it needs: the snapshot, the rebuilt model, the roots.

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

    The model is rebuilt on first use, once, and shared by ``run`` and ``try_fixes``. An FSDP2
    snapshot (its ``fsdp`` key) is replayed in this one process: the whole model is read from its
    DCP directory (or joined from every rank's shards, ``load.dcp``), rebuilt unsharded, and this
    rank's batch runs with the ``fsdp_param_dtype`` precision mode against FP32.

    Raises:
        BadInputError, VersionError, FactoryError: unreadable snapshot or model code.
    """

    def __init__(self, path: str | os.PathLike, *, device: str = "auto", dtypes: list[str] | None = None,
                 factory: str | None = None, loss_fn: str | None = None, paths: tuple[str, ...] = (),
                 progress: bool = False, rank: int | None = None):
        given = path if isinstance(path, Snapshot) else None  # a checkpoint and a batch (load.adhoc), already read
        path = given.path if given is not None else os.fspath(path)
        self.path = os.fspath(sibling_snapshot(path, rank)) if rank is not None else path
        self.snapshot = given if given is not None else load_snapshot(self.path)
        self.roots = snapshot_roots(self.snapshot, paths)  # --path roots (the import rule); the recorded cwd only names --path
        self._device, self._dtypes, self._progress = device, dtypes, progress
        self._factory, self._loss_fn = factory, loss_fn
        self._ctx: ReplayContext | None = None
        # what the recorder saw of autocast (meta.json beside the snapshot), read once per replay
        self._autocast_off = autocast_was_off(self.path) if self.snapshot.amp_dtype is not None else None

    @property
    def is_update(self) -> bool:
        """The NaN was born in the optimizer step: the update is recomputed, no model code imported."""
        snap = self.snapshot
        return update_applies(snap) and (snap.reason == schema.UPDATE or explained_by_update(self.path, snap))

    def context(self) -> ReplayContext:
        """The rebuilt model, batch and RNG every run of this replay uses (built once)."""
        if self._ctx is None:
            path, snap = self.path, self.snapshot
            amp = _amp_dtype(path, snap, self._autocast_off)
            state = load_sharded_state(path, snap)  # an FSDP snapshot's whole model; None for any other
            state = snap.model_state if state is None else state
            ctx = _context(path, snap, self._device, self._factory, self._loss_fn, self.roots, state=state)
            fork = [ctx.device.index or 0] if ctx.device.type == "cuda" else []
            with torch.random.fork_rng(devices=fork):  # the caller's RNG is left as it was (a factory may draw)
                params = {n for n, _ in ctx.build_model().named_parameters()}
            ctx.mode = precision_mode(path, snap, amp, state, params)
            self._ctx = ctx
        return self._ctx

    def run(self) -> ReplayResult:
        """Replay the step per precision and classify the first NaN/Inf-producing op."""
        if self.is_update:  # checkpoint: what a checkpoint replay read (load.adhoc), else None
            return dataclasses.replace(replay_update(self.path, self.snapshot),
                                       checkpoint=getattr(self.snapshot, "source", None))
        ctx = self.context()
        with sources_relative_to(recorded_cwd(self.snapshot)):  # source lines read the same from any directory
            result = _replay(self.path, self.snapshot, ctx, self._dtypes, self._progress, self._autocast_off)
        outside = written_outside(self.path, self.snapshot)  # NaN weights the optimizer state does not explain
        if outside and result.verdict == "nonfinite_input":
            result.summary += f" NB: {outside[0]}: {OUTSIDE_NOTE}."
        off = self._autocast_off
        if off is not None:
            result.summary += (f" NB: the snapshot says amp_dtype={self.snapshot.amp_dtype}, but the recorder saw autocast "
                               f"off on {off.get('device_type')} during training's forward (meta.json), so the run "
                               "trained in FP32 and the step is replayed as it ran, in FP32.")
        compiled = getattr(self.snapshot, "compile", None)  # how training torch.compile'd the model (format 5)
        return with_compiled(result, compiled, self.context) if compiled else result

    def try_fixes(self, result: ReplayResult) -> list[Fix]:
        """Try each fix that serves `result`'s verdict on this replay's rebuilt model, one run each at most.

        Returns:
            The fixes in the order tried; empty for a healthy step.
        """
        with sources_relative_to(recorded_cwd(self.snapshot)):  # as run() showed them: a guard matches its line
            return run_fixes(result, self.context)


def replay_snapshot(path: str | os.PathLike, *, device: str = "auto", dtypes: list[str] | None = None,
                    factory: str | None = None, loss_fn: str | None = None,
                    progress: bool = False, paths: tuple[str, ...] = (), rank: int | None = None) -> ReplayResult:
    """``Replay(path, ...).run()``: replay the snapshot's step and classify the first NaN/Inf op (see ``Replay``)."""
    return Replay(path, device=device, dtypes=dtypes, factory=factory, loss_fn=loss_fn, paths=paths,
                  progress=progress, rank=rank).run()


def try_fixes(path: str | os.PathLike, result: ReplayResult, *, device: str = "auto", factory: str | None = None,
              loss_fn: str | None = None, paths: tuple[str, ...] = ()) -> list[Fix]:
    """``Replay(path, ...).try_fixes(result)``: the fixes for `result`, on a model rebuilt from `path`.

    A caller that ran the replay itself keeps its ``Replay`` and calls ``try_fixes`` on it, which
    rebuilds nothing.
    """
    return Replay(path, device=device, factory=factory, loss_fn=loss_fn, paths=paths).try_fixes(result)


def _replay(path: str, snap: Snapshot, ctx: ReplayContext, dtypes: list[str] | None, progress: bool,
            autocast_off: dict | None) -> ReplayResult:
    mode = ctx.mode
    amp = _amp_dtype(path, snap, autocast_off)
    precisions = _precisions(mode.dtype, dtypes)  # FP32 and the low precision the run trained in
    scale = _scale(path, snap)
    bar = _Progress(progress, total=len(precisions))
    fork = [ctx.device.index or 0] if ctx.device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork):  # the caller's RNG is left as it was
        nonfinite_inputs, masks = _scan_inputs(ctx)
        # Non-finite buffers are followed through the FP32 run: one the step only writes (a
        # train-mode BatchNorm's running stats, saved after the forward wrote them) is no input.
        watch = [n.split(":", 1)[1] for n in nonfinite_inputs if n.startswith("buffer:")]
        runs: dict[str, RunTrace] = {}
        at_one: dict[str, RunTrace] = {}

        def run_precision(p: str, scale: float = scale) -> None:
            runs[p] = run_once(ctx, p, scale, on_ops=bar.ops, watch=watch if p == "float32" else None)
            if runs[p].forward_finite and not runs[p].grads_finite and scale != 1.0:
                bar.extra(f"{p} at loss scale 1")
                at_one[p] = run_once(ctx, p, 1.0, on_ops=bar.ops)

        for p in precisions:
            bar.step(f"{p} forward+backward")
            run_precision(p)
        read = runs["float32"].buffers_read or set()
        written_only = [f"buffer:{n}" for n in watch if n not in read]
        nonfinite_inputs = [n for n in nonfinite_inputs if n not in written_only]
        facts = Diagnosis("healthy", nonfinite_inputs=tuple(nonfinite_inputs), written_only=tuple(written_only),
                          masks=tuple(masks), scale=scale, recorded_loss=_float_or_none(snap.loss),
                          tried={p: r.finite for p, r in runs.items()}, scaler=snap.has_scaler,
                          mode=mode.kind, low=mode.dtype)
        bar.extra("diagnosis")
        diag = with_micro_batch(diagnose(ctx, runs, at_one, mode.dtype, scale, facts, on_ops=bar.ops), ctx.micro)
        diag = with_jump(diag, ctx.model_state)  # overflow: where its inputs grew large
        if needs_bf16(diag, runs):  # advice to switch to BF16 is given only with BF16's own run behind it
            bar.extra("bfloat16 forward+backward (the advice names it)")
            run_precision("bfloat16", 1.0)  # as the advice has it: BF16 trains without loss scaling
            diag = with_bf16(diag, runs, at_one)
        with_roots([*runs.values(), diag.trace])  # what the plot marks, worked out here, not by render
        bar.done()
    recorded = snap.device_type
    lines = tuple(verdicts.advice(diag))
    return ReplayResult(
        verdict=diag.verdict, summary=micro_summary(verdicts.summary(diag), diag, ctx.micro), culprit=diag.culprit,
        runs={p: precision_run(r, at_one.get(p), diag.origins.get(p)) for p, r in runs.items()},
        advice=[a.text for a in lines], advice_lines=lines,
        snapshot=path, step=snap.step, reason=snap.reason,
        device=str(ctx.device.type), recorded_device=str(recorded),
        device_note=_device_note(str(recorded), ctx, amp, runs),
        amp_dtype=amp, scale=scale, recorded_loss=_float_or_none(snap.loss),
        nonfinite_inputs=nonfinite_inputs, written_only_buffers=written_only, mask_inputs=masks,
        hidden_nonfinite=diag.hidden, literal_nonfinite=diag.literal, underflow_at=diag.underflow_at,
        context_ops=list(diag.context_ops),
        sdpa_backend=_sdpa_backend(diag, runs), backends=None if diag.sdpa is None else dict(diag.sdpa.backends),
        traces=runs, culprit_trace=diag.trace,
        precision_mode=mode.kind, precision_dtype=mode.dtype, precision_note=mode.describe(),
        exception=snap.exception, scaler_state=snap.scaler_state,
        checkpoint=getattr(snap, "source", None), micro_batches=ctx.micro,
    )


def _sdpa_backend(diag: Diagnosis, runs: dict[str, RunTrace]) -> str | None:
    """The SDPA backend the culprit's call ran, else the one the trained precision's run ran."""
    ran = diag.sdpa.backend if diag.sdpa is not None else None
    trace = diag.trace or list(runs.values())[min(1, len(runs) - 1)]
    return ran or backend_of(trace.sdpa_calls)


def _float_or_none(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


# -- setup ---------------------------------------------------------------------------------------
def _context(path: str, snap: Snapshot, device: str, factory: str | None, loss_fn: str | None,
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


def _amp_dtype(path: str, snap: Snapshot, autocast_off: dict | None) -> str | None:
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

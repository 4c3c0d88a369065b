"""``Replay``: re-run a failing step in FP32 and FP16/BF16 and name the op that broke it.

A ``Replay`` owns the live state of one snapshot's replay: the loaded snapshot, the model rebuilt
from it and the import roots its code comes from. ``run()`` returns a plain ``ReplayResult``;
``try_fixes(result)`` re-runs the step with each fix on the same rebuilt model.

The flow: load the snapshot (``_setup``) -> rebuild the model (``_runs.ReplayContext``) -> one run
per precision (``_runs.run_once``) -> detection (``_diagnose.diagnose``) -> the probes' evidence
(``probes``; a compiled model's step re-run compiled is the last of them) -> the registry's
refinement (``verdicts.refine``) -> the BF16 run its advice names (``_bf16``) -> the verdict's
summary and advice (``verdicts``) -> ``ReplayResult``; the fixes (``fixes``) and ``analyzer.render``
come after.

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
import os

import torch

from recorders import schema
from recorders.fp8_recipe import fp8_modules

from ..load import Snapshot, load_snapshot, recorded_cwd, snapshot_roots
from ..load.dcp import load_sharded_state, sibling_snapshot
from .verdicts import registry as verdicts
from .runs._attribution import sources_relative_to
from .runs._bf16 import needs_bf16, with_bf16
from .detection._diagnose import diagnose, precision_run, with_roots
from .runs._precision import precision_mode
from ._progress import Progress
from .detection._raised import raised_diagnosis
from .runs._runs import OpRaised, ReplayContext, run_once
from .runs._setup import amp_dtype, autocast_was_off, context, device_note, float_or_none, loss_scale, precisions, scan_inputs
from .update._result import replay_update
from .result.diagnosis import Diagnosis
from .fixes.registry import Fix, run_fixes
from .fp8.recipe import recipe_of, to_plain
from .probes import run_probes
from .result.replay_result import ReplayResult
from .result.trace import RunTrace
from .update.forensics import explained_by_update, update_applies

__all__ = ["Replay", "replay_snapshot", "try_fixes"]


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
            amp = amp_dtype(path, snap, self._autocast_off)
            state = load_sharded_state(path, snap)  # an FSDP snapshot's whole model; None for any other
            state = snap.model_state if state is None else state
            ctx = context(path, snap, self._device, self._factory, self._loss_fn, self.roots, state=state)
            fork = [ctx.device.index or 0] if ctx.device.type == "cuda" else []
            with torch.random.fork_rng(devices=fork):  # the caller's RNG is left as it was (a factory may draw)
                model = ctx.build_model()
                params = {n for n, _ in model.named_parameters()}
                ctx.fp8_recipe = recipe_of(snap, model, path=path)  # the snapshot's entry, or a converted model's
                if fp8_modules(model):  # a factory that converts: FP32 and BF16 replay its plain twin
                    ctx.convert, ctx._model = to_plain, None
            ctx.mode = precision_mode(path, snap, amp, state, params)
            self._ctx = ctx
        return self._ctx

    def run(self) -> ReplayResult:
        """Replay the step per precision and classify the first NaN/Inf-producing op."""
        notes = tuple(getattr(self.snapshot, "load_notes", ()))  # what loading found implausible, said first
        if self.is_update:  # checkpoint: what a checkpoint replay read (load.adhoc), else None
            return dataclasses.replace(replay_update(self.path, self.snapshot),
                                       checkpoint=getattr(self.snapshot, "source", None), load_notes=notes)
        ctx = self.context()
        with sources_relative_to(recorded_cwd(self.snapshot)):  # source lines read the same from any directory
            result = _replay(self.path, self.snapshot, ctx, self._dtypes, self._progress, self._autocast_off)
        return dataclasses.replace(result, load_notes=notes) if notes else result

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
    amp = amp_dtype(path, snap, autocast_off)
    wanted = precisions(mode.dtype, dtypes)  # FP32 and the low precision the run trained in
    scale = loss_scale(path, snap)
    bar = Progress(progress, total=len(wanted))
    fork = [ctx.device.index or 0] if ctx.device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork):  # the caller's RNG is left as it was
        nonfinite_inputs, masks = scan_inputs(ctx)
        # Non-finite buffers are followed through the FP32 run: one the step only writes (a
        # train-mode BatchNorm's running stats, saved after the forward wrote them) is no input.
        watch = [n.split(":", 1)[1] for n in nonfinite_inputs if n.startswith("buffer:")]
        runs: dict[str, RunTrace] = {}
        at_one: dict[str, RunTrace] = {}

        raised: dict[str, OpRaised] = {}

        def run_precision(p: str, scale: float = scale) -> None:
            try:
                runs[p] = run_once(ctx, p, scale, on_ops=bar.ops, watch=watch if p == "float32" else None)
            except OpRaised as e:  # an op raised: the culprit when FP32 ran the step (detection/_raised.py)
                if p == "float32" or "float32" not in runs:
                    raise
                raised[p], runs[p] = e, e.trace
                return
            if runs[p].forward_finite and not runs[p].grads_finite and scale != 1.0:
                bar.extra(f"{p} at loss scale 1")
                at_one[p] = run_once(ctx, p, 1.0, on_ops=bar.ops)

        for p in wanted:
            bar.step(f"{p} forward+backward")
            run_precision(p)
        read = runs["float32"].buffers_read or set()
        written_only = [f"buffer:{n}" for n in watch if n not in read]
        nonfinite_inputs = [n for n in nonfinite_inputs if n not in written_only]
        facts = Diagnosis("healthy", nonfinite_inputs=tuple(nonfinite_inputs), written_only=tuple(written_only),
                          masks=tuple(masks), scale=scale, recorded_loss=float_or_none(snap.loss),
                          tried={p: r.finite for p, r in runs.items()}, scaler=snap.has_scaler,
                          mode=mode.kind, low=mode.dtype)
        bar.extra("diagnosis")
        first = next(iter(raised.items()), None)
        diag = raised_diagnosis(facts, *first) if first is not None else None
        if first is not None and diag is None:  # not a value beyond the dtype's range: the model code's error
            raise first[1]
        if diag is None:
            diag = diagnose(ctx, runs, at_one, mode.dtype, scale, facts, on_ops=bar.ops)
        diag = run_probes(path, snap, ctx, runs, diag)  # the evidence around the verdict (probes/), compiled re-run last
        diag = verdicts.refine(diag)  # a registered verdict that narrows this one, by its detect()
        if needs_bf16(diag, runs):  # advice to switch to BF16 is given only with BF16's own run behind it
            bar.extra("bfloat16 forward+backward (the advice names it)")
            run_precision("bfloat16", 1.0)  # as the advice has it: BF16 trains without loss scaling
            diag = with_bf16(diag, runs, at_one)
        with_roots([*runs.values(), diag.trace])  # what the plot marks, worked out here, not by render
        bar.done()
    recorded = snap.device_type
    summary, lines = verdicts.summary(diag), tuple(verdicts.advice(diag))  # worded once, from the diagnosis
    ctx.fp32_reference = runs.get("float32")  # its gradients stay with the live model, for the fixes
    runs = {p: dataclasses.replace(r, grads=None) for p, r in runs.items()}  # a result holds no tensor
    trace = None if diag.trace is None else dataclasses.replace(diag.trace, captured=None, grads=None)  # no tensors on the result
    return ReplayResult(
        diagnosis=dataclasses.replace(diag, trace=trace), summary=summary, advice_lines=lines,
        runs={p: precision_run(r, at_one.get(p), diag.origins.get(p)) for p, r in runs.items()},
        snapshot=path, step=snap.step, reason=snap.reason,
        device=str(ctx.device.type), recorded_device=str(recorded),
        device_note=device_note(str(recorded), ctx, amp, runs),
        amp_dtype=amp, traces=runs, precision_note=mode.describe(),
        exception=snap.exception, scaler_state=snap.scaler_state,
        checkpoint=getattr(snap, "source", None), micro_batches=ctx.micro,
    )

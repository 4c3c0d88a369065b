"""The Recorder's lifecycle: claim the run directory at start, contain its own errors, release at the end.

The recorder must never take training down and must leave nothing behind. ``Lifecycle`` holds
the pieces that make it so, kept apart from the API and the per-step statistics:

- ``_start``: create the run directory, write meta.json and claim this rank's writer number
  (``_claim``); a process already recording the same rank gets one ``RecorderWarning``.
- ``_guard``: the recorder's own I/O. An error (a full or read-only disk) warns once, is
  counted in ``write_errors``, and training and recording go on.
- ``_stop``: any other internal error. It warns once, flushes the complete steps, stops
  recording and releases everything; training goes on with its numerics untouched.
- ``_release``: drop references and device memory, remove the optimizer hook, give back the
  writer claim and the atexit registration (also on close).
- ``_recorder_warning``: every RecorderWarning goes through it: it is kept in meta.json's ``warnings``
  (``schema.WARNING_KEYS``: a stable kind, the step, the text; at most ``schema.MAX_WARNINGS``), written
  atomically before the warning is issued, so that ``analyzer report`` repeats it after the run.

``strict=True`` re-raises in ``_guard`` and ``_stop`` instead of warning.
"""
from __future__ import annotations

import atexit
import json
import os
import warnings
import weakref

from . import schema
from ._claim import claim_writer, release_writer
from ._io import atomic_write
from ._meta import build_meta
from ._update import optimizer_meta
from .trace import TraceWriter

__all__ = ["Lifecycle", "RecorderWarning"]


class RecorderWarning(RuntimeWarning):
    """The recorder could not write something, or noticed it is used wrongly (the warning says what to
    change); training goes on."""

    __module__ = "recorders.recorder"  # its public home (re-exported there): reprs and pickles name it so


def _atexit_close(ref: weakref.ref) -> None:
    rec = ref()
    if rec is not None:
        rec.close()


class Lifecycle:
    """Mixin of ``Recorder``: start, error containment and release. Reads the Recorder's settings
    (``run_dir``, ``rank``, ``strict``, ...) and the state ``Recorder._setup`` builds; calls its
    ``_flush``.
    """

    def _start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        meta = build_meta(model=self.model, rank=self.rank, world_size=self.world_size,
                          device_type=self.device_type, amp_dtype=self.amp_dtype, scaler=self.scaler,
                          factory=self.factory, factory_kwargs=self.factory_kwargs, loss_fn=self.loss_fn,
                          config=self.config, fsdp=self._fsdp,
                          optimizer=optimizer_meta(self.optimizer, self._params), compile=self.compile,
                          warnings=self.__dict__.get("_warnings_kept"), fp8_recipe=self._fp8.recipe,
                          fp8=self._fp8.settings(), ddp=self._ddp.published())
        data = json.dumps(meta, indent=1).encode()
        self.writer, others = claim_writer(self.run_dir, self.rank, data)
        self._meta = meta
        # a Recorder dropped without close() gives its slot back too (a notebook cell run again)
        weakref.finalize(self, release_writer, self.run_dir, self.rank, self.writer)
        self._writer = TraceWriter(self.run_dir, self.rank, self.writer)
        if others:
            who = ", ".join(f"pid {o.get('pid')} on host {o.get('host')}" for o in others)
            self._recorder_warning(
                "shared_rank", f"amp-autopsy recorder: rank {self.rank} of {self.run_dir} is already being recorded by "
                f"{who}; this process (pid {os.getpid()}) records it as writer {self.writer} (its files "
                f"are named *-r{self.rank:05d}-w{self.writer}-*). If these are processes of one "
                "multi-GPU launch, initialise torch.distributed before building the Recorder so each "
                "has its own rank, or give each process its own run directory", RecorderWarning,
                stacklevel=4)

    def _stop(self, where: str, error: Exception) -> None:
        """An internal error: warn once, stop recording, keep the rows already written."""
        self.write_errors += 1
        if self.strict:
            raise error
        stop_msg = None
        if not self._stop_warned:
            msg = " ".join(f"{type(error).__name__}: {error}".split())[:300]
            stop_msg = (f"amp-autopsy recorder stopped recording {self.run_dir} after an internal error in "
                        f"{where}: {msg}. Training continues, unchanged; the record ends here (please report "
                        "this with the message)")
            self._keep_warning("stopped", stop_msg)  # while meta.json is still written
        self.stopped = True
        if where != "flush":
            try:  # keep the complete steps buffered so far
                self._flush()
            except Exception:  # noqa: BLE001 - best effort: the warning below says the record ends
                pass
        if stop_msg is not None:
            self._stop_warned = True
            warnings.warn(stop_msg, RecorderWarning, stacklevel=3)
        self._release()

    def _update_meta(self, **fields) -> None:
        """Rewrite this writer's meta.json with `fields` changed (atomically; rare: misuse, close)."""
        meta = getattr(self, "_meta", None)
        if meta is None or self.stopped:
            return
        meta.update(fields)
        data = json.dumps(meta, indent=1).encode()
        self._guard("update meta.json", atomic_write, self.run_dir / schema.meta_name(self.rank, self.writer),
                    lambda f: f.write(data))

    def _misuse_warning(self, kind: str, message: str, step: int | None = None) -> None:
        """A misuse of the API the recorder noticed (``_mistakes``): one RecorderWarning, training goes on."""
        self._recorder_warning(kind, message, stacklevel=4, step=step)

    def _recorder_warning(self, kind: str, message: str, category: type[Warning] = RecorderWarning,
                          stacklevel: int = 3, step: int | None = None) -> None:
        """Issue a RecorderWarning of `kind` (a key of ``schema.WARNING_KINDS``), kept in meta.json first.

        `stacklevel` counts from the caller, as for ``warnings.warn``. `step`: the step the warning is
        about (default: the step ``begin_step`` last named).
        """
        self._keep_warning(kind, message, step)
        warnings.warn(message, category, stacklevel=stacklevel + 1)

    def _keep_warning(self, kind: str, message: str, step: int | None = None) -> None:
        """Append the warning to meta.json's ``warnings`` (host values only: no device sync); never raises."""
        try:
            kept = self.__dict__.setdefault("_warnings_kept", [])
            if len(kept) >= schema.MAX_WARNINGS:
                return
            if step is None:
                step = self.__dict__.get("_step")
            kept.append({"kind": kind, "step": step if isinstance(step, int) else None,
                         "message": str(message)[:schema.MAX_WARNING_CHARS]})
            if getattr(self, "_meta", None) is not None:  # before _start: build_meta takes them
                self._update_meta(warnings=list(kept))
        except Exception:  # noqa: BLE001 - keeping a warning must never take training down
            pass

    def _release(self) -> None:
        """Drop references and device memory; unregister from atexit and the writer claims."""
        watch = self.__dict__.get("_watch")
        if watch is not None:
            watch.release()  # the autocast pre-hooks
        ddp = self.__dict__.get("_ddp")
        if ddp is not None:
            ddp.remove()  # the first forward's hook, if no forward ran
        fp8 = self.__dict__.get("_fp8")
        if fp8 is not None:
            fp8.remove()  # a sampled step's FP8 hooks
        try:
            atexit.unregister(self._atexit)
        except AttributeError:  # stopped inside __init__, before atexit registration
            pass
        self._batch = self._rng = None
        self._buffers = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._update_sample = None
        rewind = self.__dict__.pop("_rewind", None)  # Recorder(rewind=K)'s host copies and optimizer pre-hook
        if rewind is not None:
            rewind.release()
        if self._layers is not None:
            self._layers.release()
        if self._writer is not None:
            release_writer(self.run_dir, self.rank, self.writer)

    def _guard(self, what: str, fn, *args):
        """Run the recorder's own I/O: on error warn once and carry on (strict: raise)."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the recorder must never take training down
            self.write_errors += 1
            if self.strict:
                raise
            if not self._warned:
                self._warned = True  # NB: set first: keeping the warning rewrites meta.json through _guard
                self._recorder_warning(
                    "write_error",
                    f"amp-autopsy recorder could not {what} in {self.run_dir}: {type(e).__name__}: {e}. "
                    "Training continues but the record is incomplete (further write errors are "
                    "counted in rec.write_errors, not warned again; strict=True raises instead)",
                    RecorderWarning, stacklevel=3,
                )
            return None

    def _live(self) -> bool:
        """Whether a step call should record: False when disabled or stopped; raises when the recorder is closed."""
        if not self.enabled:
            return False
        if self.closed:
            raise RuntimeError(f"the recorder for {self.run_dir} is closed")
        return not self.stopped

"""The exception a training loop raised inside the Recorder's ``with`` block: its step is kept.

``Recorder.__exit__`` calls ``record_exception`` when the block raised. When a step is open
(``begin_step`` ran, ``end_step`` did not: the optimizer has not stepped, so the weights are still
the ones the failing forward used) it writes that step:

- a trace row, measured from the gradients as they are when the exception arrives (none yet
  when the forward raised); the loss is null (``end_step`` never received it) unless a framework
  callback kept it from the forward;
- a snapshot of reason ``exception`` (``schema.REASON_EXCEPTION``): the pre-step weights and
  buffers, the batch, the RNG, and the exception's entry (``schema.EXCEPTION_KEYS``: type,
  message and the last user frames, as strings: the file stays ``weights_only``-loadable).

``meta.json`` records the entry in every case (``step`` None: it was raised outside any open
step, before the loop or in a data loader between steps). A ``KeyboardInterrupt`` or
``SystemExit`` is an interruption, not a failure: meta.json only, never a snapshot.

The exception itself always propagates unchanged: every write here is guarded, and one that
fails warns once (``RecorderWarning``), even with ``strict=True``.

NB: ``kill -9``, a segfault or a hard CUDA fault ends the process without running ``__exit__``:
such a run keeps the trace parts already flushed and nothing of its last step.
"""
from __future__ import annotations

import functools
import json
import os
import traceback

import torch

from . import schema
from ._io import atomic_write
from ._lifecycle import RecorderWarning

__all__ = ["exception_entry", "record_exception"]

_MAX_MESSAGE = 2000
_MAX_FRAMES = 8
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _is_user(filename: str) -> bool:
    """A frame of the user's code: not torch, not amp-autopsy's recorders, not the standard library
    or an installed package (Lightning's and transformers' loops are frameworks, not the user's)."""
    path = os.path.abspath(filename)
    if path.startswith((_PACKAGE + os.sep, _TORCH + os.sep)) or filename.startswith("<"):
        return False
    parts = path.split(os.sep)
    return "site-packages" not in parts and "dist-packages" not in parts and not _stdlib(path)


def _stdlib(path: str) -> bool:
    import sysconfig

    std = sysconfig.get_paths().get("stdlib") or ""
    return bool(std) and path.startswith(os.path.abspath(std) + os.sep)


def _frame_text(f: traceback.FrameSummary) -> str:
    code = " ".join((f.line or "").split())[:200]
    return f"{f.filename}:{f.lineno} in {f.name}" + (f": {code}" if code else "")


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _message(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception as e:  # noqa: BLE001 - a user exception whose __str__ raises
        text = f"<str() of the exception raised {type(e).__name__}>"
    return text[:_MAX_MESSAGE]


def exception_entry(exc: BaseException, step: int | None, last_step: int | None) -> dict:
    """The ``exception`` entry of meta.json and of the snapshot (``schema.EXCEPTION_KEYS``).

    Example:
        >>> try:
        ...     raise RuntimeError("The total norm of order 2.0 for gradients is non-finite")
        ... except RuntimeError as e:
        ...     entry = exception_entry(e, 5, 5)
        >>> entry["type"], entry["step"], entry["failure"]
        ('RuntimeError', 5, True)
    """
    try:
        frames = traceback.extract_tb(exc.__traceback__)
    except Exception:  # noqa: BLE001 - a damaged traceback still leaves the type and message
        frames = []
    user = [f for f in frames if _is_user(f.filename)][-_MAX_FRAMES:]
    shown = [_frame_text(f) for f in user]
    if frames and (not user or frames[-1] is not user[-1]):  # where it was raised: clip_grad_norm_, an op...
        shown = shown[-(_MAX_FRAMES - 1):] + [_frame_text(frames[-1])]
    entry = {"type": _type_name(exc), "message": _message(exc), "frames": shown,
             "step": None if step is None else int(step), "last_step": None if last_step is None else int(last_step),
             "failure": isinstance(exc, Exception)}
    assert tuple(entry) == schema.EXCEPTION_KEYS
    return entry


def record_exception(rec, exc: BaseException, loss=None) -> None:
    """Keep what the exception `exc` leaves of recorder `rec`'s run, then close it. Never raises.

    ``rec`` is a ``Recorder`` (its ``_record``, ``_snapshot``, ``_guard`` and ``_flush``). `loss`: the
    step's unscaled loss when the caller kept it (a framework callback's forward hook), else None.
    """
    if not rec.enabled or rec.closed:
        return
    strict, sync = rec.strict, getattr(rec, "sync_failures", False)
    # NB: strict=False for the recorder's own errors here: the training exception must stay the one raised.
    # No collective either (sync_failures): the other ranks are not in the same place.
    rec.strict, rec.sync_failures = False, False
    try:
        open_step = not rec.stopped and rec._step is not None and rec._last is None
        entry = exception_entry(exc, rec._step if open_step else None, rec._step)
        if open_step and entry["failure"]:
            rec._guard("record the trace row of the step that raised", _row, rec, loss)
            rec._guard("snapshot the step that raised",
                       functools.partial(rec._snapshot, schema.REASON_EXCEPTION, exception=entry))
            rec._guard("write the trace of the step that raised", rec._flush)
        if getattr(rec, "_meta", None) is not None:  # later meta.json rewrites (close: steps_begun) keep it
            rec._meta["exception"] = entry
        meta = rec.run_dir / schema.meta_name(rec.rank, rec.writer)
        if rec._writer is not None and meta.exists():
            rec._guard("record the exception in meta.json", _write_meta, meta, entry)
    except Exception as e:  # noqa: BLE001 - a bug here must not replace the training exception
        _warn(rec, e)
    finally:
        rec.strict, rec.sync_failures = strict, sync
        try:
            rec.close()
        except Exception as e:  # noqa: BLE001 - the training exception is the one that propagates
            _warn(rec, e)


def _row(rec, loss) -> None:
    """The step's trace row from the gradients as they are now (the loss never reached end_step)."""
    if rec._last is not None:
        return
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        loss = None
    with torch.no_grad():
        row, _failure, _reason = rec._record(loss)
    rec._rows.append(row)
    rec._last = row


def _write_meta(path, entry: dict) -> None:
    meta = json.loads(path.read_text())
    meta["exception"] = entry
    data = json.dumps(meta, indent=1).encode()
    atomic_write(path, lambda f: f.write(data))


def _warn(rec, e: Exception) -> None:
    rec.write_errors += 1
    if rec._warned:
        return
    rec._warned = True
    rec._recorder_warning("exception_not_recorded", "amp-autopsy recorder could not record the training "
                          f"exception in {rec.run_dir}: {type(e).__name__}: {e}. The training exception is raised "
                          "as it is; the record of its step may be incomplete", RecorderWarning, stacklevel=4)

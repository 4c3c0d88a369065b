"""The Recorder's snapshots of the current step: a failing step, a manual one, the step that broke the weights.

A mixin of ``Recorder`` (``recorders.recorder``): it reads the Recorder's step state (the batch,
the RNG captured by ``begin_step``, the pre-step buffers, the step's trace row) and writes one
snapshot file atomically, claimed so that it never replaces another process's (``snapshot.py``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import schema
from . import triggers as _triggers
from ._lifecycle import RecorderWarning
from ._update import UpdateCheck, optimizer_entry, update_entry
from .snapshot import build_snapshot, claim_snapshot, write_snapshot

__all__ = ["Snapshotting"]


def _rng_states(rng: dict | None) -> dict | None:
    """begin_step's RNG capture as the snapshot stores it: the CPU generator's state as a tensor."""
    if rng is None or not isinstance(rng.get("cpu"), torch.Generator):
        return rng
    return {**rng, "cpu": rng["cpu"].get_state()}


class Snapshotting:
    """``Recorder._snapshot`` and ``check_update``'s optimizer step post hook."""

    def _setup_update_check(self) -> None:
        """check_update: the weights' finiteness now, and the optimizer step post hook."""
        self._update_check = UpdateCheck(self._params, self._device, self._single_device)
        self._weights_finite = not self._update_check.nonfinite()  # NB: host sync, once at setup
        register = getattr(self.optimizer, "register_step_post_hook", None)
        if callable(register):
            self._hook = register(self._after_optimizer_step)
        else:  # not a torch.optim.Optimizer: the rest of the record is still worth having
            self._recorder_warning("no_step_hook", "amp-autopsy recorder: check_update=True needs a "
                                   "torch.optim.Optimizer (its register_step_post_hook); "
                                   f"{type(self.optimizer).__name__} has none, so optimizer steps are not "
                                   "checked", RecorderWarning, stacklevel=4)  # the Recorder(...) line

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        """check_update: the optimizer's step post hook. Snapshot the step that broke the weights."""
        if not self.enabled or self.closed or self.stopped:
            return
        try:
            with torch.no_grad():
                bad = self._update_check.nonfinite()
            broke = bool(bad) and self._weights_finite  # edge: the weights were finite before this step
            self._weights_finite = not bad
            if not broke or self._step is None or self._triggers.exhausted:
                return
            self._triggers.fired += 1
            names = [self._param_names.get(id(self._params[i]), f"param{i}") for i in bad]
            self._snapshot(_triggers.UPDATE, update=update_entry(self.model, names))
            self._flush()  # the process may die at the next forward: the trace reaches the disk now
        except Exception as e:  # noqa: BLE001 - the recorder must never take training down
            self._stop("the optimizer step post hook (check_update)", e)

    def _snapshot(self, reason: str, update: dict | None = None, exception: dict | None = None,
                  spike: dict | None = None) -> Path | None:
        """Snapshot the current step. With `update` (reason "update"): the weights after the step.
        With `exception` (reason "exception"): the entry of the exception the step raised."""
        last = self._last or {}
        scale = last.get("scale")
        if not last and self.scaler is not None and self.scaler._scale is not None:
            scale = self.scaler.get_scale()  # manual snapshot before end_step
        path = self.run_dir / schema.SNAPSHOT_DIR / schema.snapshot_name(self._step, self.rank, reason,
                                                                         self.writer)
        pre, missed = self._buffers.pre_step() if update is None else ({}, [])
        # NB: captured here, not in write(): a state_dict() that raises is an internal error (_stop)
        optim = optimizer_entry(self.optimizer, self._param_names)
        if missed and not self._warned:
            self._warned = True
            self._recorder_warning(
                "post_forward_buffers", f"amp-autopsy recorder: step {self._step} wrote buffers in place that no "
                f"earlier step wrote ({', '.join(missed[:4])}); snapshot {path.name} holds their post-forward values",
                RecorderWarning, stacklevel=4)

        fsdp = None
        if self._fsdp is not None:
            fsdp = self._fsdp_snapshot(reason, pre)  # before write(): collective, so never skipped by an error

        micro = self._micro.entry(self._batch)  # NB: before write(): a list that is not micro-batches raises nothing
        window = getattr(self, "_rewind", None)  # Recorder(rewind=K): the steps before this one (recorders/_rewind.py)
        rewind = None if window is None else self._guard("copy the rewind window", window.entry, self._step, last)

        watch = self.__dict__.get("_ddp")
        ddp = None if watch is None else watch.entry()  # the hook as it is now (registered after the Recorder)

        def write():
            snap = build_snapshot(
                step=self._step, reason=reason, model=self.model, batch=self._batch, rng=_rng_states(self._rng),
                factory=self.factory, factory_kwargs=self.factory_kwargs, loss_fn=self.loss_fn,
                amp_dtype=self.amp_dtype, device_type=self.device_type, scale=scale,
                scaler_state=self.scaler.state_dict() if self.scaler is not None else None,
                loss=last.get("loss"), loss_dtype=last.get("loss_dtype"), grad_norm=last.get("grad_norm"),
                rank=self.rank, world_size=self.world_size, pre_step_buffers=pre, cwd=self._cwd, fsdp=fsdp,
                optimizer=optim, update=update, exception=exception, compile=self.compile, micro_batches=micro,
                spike=spike, rewind=rewind, fp8_recipe=self._fp8.recipe, fp8=self._fp8.entry(), ddp=ddp,
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            if path in self.snapshots:  # this Recorder's own file (a second manual snapshot): replace
                return write_snapshot(path, snap)
            return claim_snapshot(path.parent, snap, self.writer)  # never over another process's

        written = self._guard(f"write snapshot {path.name}", write)
        if written is not None and written not in self.snapshots:
            self.snapshots.append(written)
        if written is not None and micro is not None and not getattr(self, "_meta", {}).get("micro_batches_kept"):
            self._update_meta(micro_batches_kept=True)  # once: the report stops saying "the first only"
        return written

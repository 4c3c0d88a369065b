"""The Recorder's per-step statistics: one read of the gradients and one host sync per healthy step.

``StepStats`` is the hot path of ``Recorder.end_step``, kept apart from the Recorder's API and
I/O: every parameter's gradient norm, the loss, loss scale and learning rate cross to the host
in one transfer (the total norm is summed there); per-parameter statistics stay on the device in
the ``LayerBuffer`` until a flush.

A healthy step reads each gradient once, for its norm (``_norms.norm_list``); its layer row's
zero fractions and parameter norms come from the update columns' fixed sample
(``_sample.UpdateSample``), a few thousand elements per parameter, written straight into the
``LayerBuffer``. A failing step (non-finite
norm or loss) takes the cold path: exact non-finite counts, exact zero counts and the exact
parameter norms, read in full. Sharded (FSDP2 ``DTensor``) parameters are measured on this
rank's local shard.
"""
from __future__ import annotations

import functools
import math
import operator
import time

import torch

from . import schema
from . import triggers as _triggers
from ._norms import nonzero_counts, norm_list, norms
from .trace import GRAD_NORM, PARAM_NORM, ZERO_FRAC

__all__ = ["StepStats", "local_tensor"]

_grad = operator.attrgetter("grad")
_item = torch.Tensor.item


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str | None:
    return schema.dtype_name(dtype)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 parameters and gradients; no collective); others as they are."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class StepStats:
    """Mixin of ``Recorder``: computes one step's trace row and per-layer statistics."""


    def _scale_state(self) -> tuple[torch.Tensor | None, bool]:
        """(scale tensor used by this step's backward, whether the grads are already unscaled)."""
        scaler = self.scaler
        if scaler is None or scaler._scale is None:
            return None, False
        from torch.amp.grad_scaler import OptState

        # UNSCALED: the loop called scaler.unscale_(opt); STEPPED: scaler.step(opt) already ran
        # (end_step is late, but the gradients are unscaled all the same).
        states = scaler._per_optimizer_states  # NB: a defaultdict: .get, never [], to not add entries
        if self.optimizer is not None:
            st = states.get(id(self.optimizer))
            unscaled = st is not None and st["stage"] is not OptState.READY
        else:
            unscaled = any(st["stage"] is not OptState.READY for st in states.values())
        return scaler._scale, unscaled

    def _record(self, loss) -> tuple[dict, str | None, str | None]:
        step = self._step
        scale_t, unscaled = self._scale_state()
        params = self._params
        grads = list(map(_grad, params))  # (map: no Python frame per parameter, ~30% faster cache-cold)
        layer_due = step % self.config.layer_every == 0
        # the sample's check that no storage was replaced, while the parameters are in cache
        key = self._update_sample.key() if layer_due else None
        if all(g is not None for g in grads):  # the common case: one comprehension, no per-parameter branch
            idx, sel = range(len(grads)), None
        else:
            idx = [i for i, g in enumerate(grads) if g is not None]
            grads, sel = [grads[i] for i in idx], idx
        if self._sharded:
            grads = [local_tensor(g) for g in grads]

        # NB: the one read of the gradients on a healthy step
        parts = norm_list(grads, self._device, self._fused_norms) if grads else []
        n = len(parts)
        loss_t = None
        if isinstance(loss, torch.Tensor):  # (no_grad: stacked as it is when it can be)
            loss_t = loss if loss.dim() == 0 else loss.reshape(())
            if loss_t.device != self._device or not loss_t.is_floating_point():
                loss_t = loss_t.to(self._device, loss_t.dtype if loss_t.is_floating_point() else self._acc)
            parts.append(loss_t)
        if scale_t is not None:
            parts.append(scale_t.reshape(()).to(self._device))
        lr = self._lr()
        lr_t = lr if isinstance(lr, torch.Tensor) else None  # a tensor lr (fused/capturable optimizers)
        if lr_t is not None:
            parts.append(lr_t.detach().reshape(()).to(self._device))
        fp8 = self._fp8.take()  # an fp8_every-th step's FP8 cast counts, on the device (recorders/_fp8_watch.py)
        fp8_vals = None
        if self._host_reads and not layer_due:
            # NB: CPU tensors: reading each value needs no sync, and costs less than stacking ~80
            # cache-cold 0-dim tensors (~45 us on the benchmark's model); the values are the same
            stacked, vals = None, list(map(_item, parts))
            fp8_vals = None if fp8 is None else fp8.tolist()
        else:
            # NB: host sync: the one per step. Every gradient norm, the loss, scale and lr, in one
            # transfer (stack promotes: a float64 loss or lr makes it float64, every value exact),
            # the FP8 cast counts of a sampled step with them (float64: counts exact).
            stacked = torch.stack(parts) if parts else None
            if fp8 is None:
                vals = stacked.tolist() if parts else []
            else:
                vals = (torch.cat([stacked.to(fp8.dtype), fp8]) if parts else fp8).tolist()
                vals, fp8_vals = vals[:len(parts)], vals[len(parts):]
        host_norms, vals = vals[:n], vals[n:]
        loss_v = vals.pop(0) if loss_t is not None else (None if loss is None else float(loss))
        scale_v = vals.pop(0) if scale_t is not None else None
        lr_v = vals.pop(0) if lr_t is not None else lr
        divide = scale_t is not None and not unscaled  # the gradients are still multiplied by the scale
        grad_norm = None
        if grads:  # summed in float64 on the host, as vector_norm(dtype=float64) would: NaN if any is NaN
            grad_norm = math.sqrt(math.fsum(map(operator.mul, host_norms, host_norms)))
            grad_norm = grad_norm / scale_v if divide else grad_norm

        cold = not (grad_norm is None or math.isfinite(grad_norm)) or not (loss_v is None or math.isfinite(loss_v))
        counts, gnorm = None, None
        if cold and grads:
            counts, fixed = self._cold_grads(grads, idx, host_norms, scale_v if divide else None)
            if fixed is not None:  # float32 overflowed on finite gradients: their float64 norms
                gnorm, grad_norm = torch.tensor(fixed, dtype=torch.float32, device=self._device), math.hypot(*fixed)
        nonfinite = sum(c for c in counts if c) if counts is not None else 0
        health = _triggers.StepHealth(loss_v, nonfinite == 0, scale_v, grad_norm)
        snap_reason = self._triggers.check(health)
        holding = self._triggers.holding
        failure = holding[0] if holding else None
        if self.sync_failures and self.world_size > 1:
            failure, snap_reason = self._sync_failure(failure, snap_reason)
        fired = self._fp8.record(step, self.rank, fp8_vals, snap_reason is None) if fp8_vals is not None else None
        if fired is not None:  # an FP8 cast past the limits: a snapshot, no failure
            snap_reason = schema.FP8

        if grads and (layer_due or failure is not None or snap_reason is not None):
            if gnorm is None:
                if stacked is None:  # (a failing step without a layer row due, read value by value)
                    stacked = torch.stack(parts[:n])
                gnorm = stacked[:n] / scale_t.to(self._device) if divide else stacked[:n]
            self._layer_row(step, sel, grads, gnorm, counts, cold, key)
        row = {
            "step": step,
            "rank": self.rank,
            "wall_time": time.time(),
            "loss": loss_v,
            "loss_dtype": _dtype_name(loss.dtype) if isinstance(loss, torch.Tensor) else None,
            "scale": scale_v,
            # GradScaler skips exactly when a gradient it unscales is non-finite: the exact count above.
            "skipped": health.overflowed,
            "grad_norm": grad_norm,
            "lr": lr_v,
            "nonfinite_grads": nonfinite if grads else None,
        }
        return row, failure, snap_reason

    def _cold_grads(self, grads, idx, norms, scale) -> tuple[list[int], list[float] | None]:
        """Failing step only: (exact non-finite counts, the norms divided by `scale` (None: not
        scaled) with float64 norms where float32 overflowed, or None when none did)."""
        norms = [x / scale for x in norms] if scale is not None else list(norms)
        counts = [0] * len(self._params)
        overflowed = False
        for j, (i, g) in enumerate(zip(idx, grads)):
            if not math.isfinite(norms[j]):
                counts[i] = int(g.numel() - torch.isfinite(g).sum().item())
                if counts[i] == 0:  # every element finite, but the sum of squares overflowed float32
                    exact = torch.linalg.vector_norm(g.detach().to("cpu", torch.float64)).item()
                    norms[j] = exact / scale if scale is not None else exact
                    overflowed = True
        return counts, norms if overflowed else None

    def _layer_row(self, step, sel, grads, gnorm, counts, exact: bool, key: list[int] | None) -> None:
        """Store this step's per-layer row. `exact` (a failing step): zero fractions and parameter
        norms counted over every element; else from the samples (see the module docstring). `key`:
        the sample's ``key()``, taken earlier in the step, or None."""
        if self._layers.full:
            self.flush()
        block = self._layers.next_block()
        where = None if sel is None else self._index(sel)
        if sel is None:
            by_param = grads
            block[GRAD_NORM].copy_(gnorm)
        else:
            by_param = [None] * len(self._params)
            for i, g in zip(sel, grads):
                by_param[i] = g
            block[GRAD_NORM].fill_(math.nan)
            if sel:
                block[GRAD_NORM].index_copy_(0, where, gnorm.to(block.dtype))
        # the change since the previous recorded row, on a fixed sample: device-side, no host sync
        has_update = self._update_sample.measure_into(self._layers.next_sampled(), None if exact else by_param, key)
        if exact:
            params = [local_tensor(p) for p in self._params] if self._sharded else self._params  # no_grad: no detach
            block[PARAM_NORM].copy_(norms(params, self._device, self._single_device))
            numel = self._numel if where is None else self._numel.index_select(0, where)
            zero_frac = (1.0 - nonzero_counts(grads, self._device).to(self._acc) / numel).float()
            if sel is None:
                block[ZERO_FRAC].copy_(zero_frac)
            elif sel:  # the parameters without a gradient: NaN already (no gradient given)
                block[ZERO_FRAC].index_copy_(0, where, zero_frac)
        self._layers.commit(step, sel, counts, has_update)

    def _index(self, sel: list[int]) -> torch.Tensor:
        """Device index tensor of `sel`, cached: building it is a host-to-device copy."""
        key = tuple(sel)
        if self._index_cache[0] != key:
            self._index_cache = (key, torch.tensor(sel, dtype=torch.long, device=self._device))
        return self._index_cache[1]

    def _lr(self) -> float | torch.Tensor | None:
        if self.optimizer is None or not self.optimizer.param_groups:
            return None
        lr = self.optimizer.param_groups[0].get("lr")
        return lr if lr is None or isinstance(lr, torch.Tensor) else float(lr)

    def _sync_failure(self, failure, snap_reason):
        """All ranks learn whether any rank failed; healthy ranks snapshot the step as peer_failure.

        Edge-triggered like the other reasons: a healthy rank snapshots the first step of a
        stretch in which some rank fails. Every rank must call end_step for every step.
        """
        dist = torch.distributed
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")
        flag = torch.tensor([1.0 if failure is not None else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        any_failed = flag.item() > 0  # NB: host sync: only with sync_failures=True, after the collective
        if any_failed and failure is None:
            failure = _triggers.PEER_FAILURE
            if not self._peer_failing and not self._triggers.exhausted:
                snap_reason = _triggers.PEER_FAILURE
                self._triggers.fired += 1
        self._peer_failing = any_failed
        return failure, snap_reason

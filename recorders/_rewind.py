"""The rewind window (``Recorder(rewind=K)``): the state at a recent start and every step since, on the host.

A snapshot holds one step. To replay the steps that led to it (``analyzer replay SNAPSHOT --steps K``),
the recorder keeps, as host copies:

- a *start*: the weights and buffers (``model.state_dict()``) and the optimizer's ``state_dict()`` as
  ``begin_step`` finds them, taken every K steps;
- per step since the older of the two latest starts: the batch (its tensors copied, never held by
  reference: a loop may refill one batch buffer in place), the RNG state ``begin_step`` captured, the
  hyperparameters each param group had when the optimizer stepped (an optimizer step pre-hook: the lr a
  scheduler set between ``end_step`` and ``optimizer.step`` included; no call: the step was skipped, as
  GradScaler skips it), and from the step's trace row its loss, loss scale, ``skipped`` and gradient norm.

Two starts are kept, K steps apart, so that a snapshot at any step after the first K finds a start at
least K steps before it (between K and 2K-1). Memory: 2 x (weights + buffers + optimizer state) + up to
2K batches (Adam: about 6x the weights + 2K batches). Cost: one copy of the weights and optimizer state
every K steps, and one copy of each batch; on CUDA the copies go to pinned host buffers with
``non_blocking=True`` (reused once allocated, so no host sync per step), waited for only when a snapshot
is written. FSDP2-sharded models are not kept (the recorder warns once).
"""
from __future__ import annotations

from collections import deque
from typing import Any

import torch

from . import schema
from .compiled import clean_name
from ._update import optimizer_class

__all__ = ["RewindWindow", "rewind_steps", "rewind_window"]

_PRIMITIVES = (int, float, str, bool, bytes, type(None), torch.dtype, torch.device, torch.Size)
_ROW = ("loss", "scale", "skipped", "grad_norm", "lr")  # the trace row's values each step keeps


def rewind_steps(rewind: int | None, optimizer) -> int | None:
    """``Recorder(rewind=...)`` validated: None (off) or an int >= 1, with the optimizer whose state it keeps."""
    if rewind is None:
        return None
    if isinstance(rewind, bool) or not isinstance(rewind, int) or rewind < 1:
        raise ValueError(f"rewind must be None or an int >= 1 (steps kept before a snapshot), got {rewind!r}")
    if optimizer is None:
        raise ValueError("rewind=K needs the optimizer, whose state the window keeps: "
                         "Recorder(..., optimizer=opt, rewind=K)")
    return rewind


def rewind_window(rec, model: torch.nn.Module) -> RewindWindow | None:
    """The Recorder's window (``rec._rewind_k`` steps), None when off; an FSDP2-sharded model: warn once, None."""
    if rec._rewind_k is None:
        return None
    if rec._sharded:
        rec._recorder_warning("rewind_off", "amp-autopsy recorder: rewind=K does not keep FSDP2-sharded models; "
                              "their snapshots hold one step", stacklevel=5)
        return None
    return RewindWindow(rec._rewind_k, model, rec.optimizer, rec._param_names, rec._micro)


def _host(obj: Any, old: Any, pin: bool, depth: int = 0) -> Any:
    """`obj` with every tensor copied to the host, into `old`'s tensor at the same place when it fits.

    numpy arrays become tensors; objects ``torch.load(weights_only=True)`` cannot read become their type
    name as a string (an optimizer's callable hyperparameter), so one odd value never breaks a snapshot.
    """
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        src = src.to_local() if callable(getattr(src, "to_local", None)) else src
        if src.layout != torch.strided:
            return src.to("cpu", copy=True)  # NB: sparse: rare, copied as it is (a sync on CUDA)
        if (isinstance(old, torch.Tensor) and old.shape == src.shape and old.dtype == src.dtype
                and old.device.type == "cpu" and old.is_contiguous()):
            dst = old
        else:
            dst = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin and src.is_cuda)
        dst.copy_(src, non_blocking=src.is_cuda)
        return dst
    if isinstance(obj, _PRIMITIVES):
        return obj
    if depth < 32 and isinstance(obj, dict):
        prev = old if isinstance(old, dict) else {}
        return {(k if isinstance(k, (int, str)) else repr(k)[:200]): _host(v, prev.get(k), pin, depth + 1)
                for k, v in obj.items()}
    if depth < 32 and isinstance(obj, (list, tuple)):
        prev = old if isinstance(old, (list, tuple)) and len(old) == len(obj) else [None] * len(obj)
        items = [_host(v, o, pin, depth + 1) for v, o in zip(obj, prev)]
        return items if isinstance(obj, list) else tuple(items)
    if type(obj).__module__ == "numpy" and hasattr(obj, "dtype"):
        return torch.as_tensor(obj).clone()
    return f"<{type(obj).__module__}.{type(obj).__qualname__}>"


def _hyper(group: dict) -> dict:
    """A param group's hyperparameters as the optimizer step uses them (numbers, bools, tuples of numbers)."""
    out = {}
    for k, v in group.items():
        if k == "params" or not isinstance(k, str):
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            out[k] = v.detach().clone()  # a tensor lr (capturable/fused): read at snapshot time, not per step
        elif isinstance(v, (bool, int, float)) or v is None:
            out[k] = v
        elif isinstance(v, (list, tuple)) and len(v) <= 8 and all(isinstance(x, (int, float)) for x in v):
            out[k] = tuple(v)
    return out


def _plain_hyper(groups: list[dict] | None) -> list[dict] | None:
    if groups is None:
        return None
    return [{k: (float(v.item()) if isinstance(v, torch.Tensor) else v) for k, v in g.items()} for g in groups]


class _Start:
    """Weights, buffers and optimizer state at ``begin_step`` of `step`, on the host."""

    def __init__(self, step: int, index: int, model_state: dict, optim: dict | None):
        self.step, self.index, self.model_state, self.optim = step, index, model_state, optim


class RewindWindow:
    """The last steps' batches and RNG, and the state at the window's start (see the module docstring).

    Args:
        steps: K, the steps a snapshot can replay at least (once K steps have run).
        model: the (unwrapped) model; its ``state_dict()`` is the start state.
        optimizer: the ``torch.optim.Optimizer`` stepping it (its step pre-hook is registered here).
        param_names: ``id(parameter)`` -> its name in ``model_state``.
        micro: the Recorder's ``MicroBatches`` (which batches are lists of micro-batches).
    """

    def __init__(self, steps: int, model: torch.nn.Module, optimizer, param_names: dict[int, str], micro):
        self.k = steps
        self.model, self.optimizer, self.names, self.micro = model, optimizer, param_names, micro
        self.pin = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
        self.starts: deque[_Start] = deque(maxlen=2)
        self.steps: deque[dict] = deque()
        self.begun = 0  # begin_step calls so far: a start every K of them
        self._pool: list = []  # batches that left the window: their host buffers are reused
        self._event = None  # the last non_blocking copy's CUDA event, waited for at snapshot time
        register = getattr(optimizer, "register_step_pre_hook", None)
        self._hook = register(self._stepping) if callable(register) else None

    def begin(self, step: int, batch: Any, rng: dict | None) -> None:
        """``begin_step``: a new start every K steps (the older of two is reused), then this step's copies."""
        if self.steps and self.steps[-1]["row"] is None and self.steps[-1]["step"] == step:
            redo = self.steps.pop()  # begin_step again without end_step: the same step, begun anew
            index = redo["index"]
            self._pool.append(redo["batch"])
        else:
            index = self.begun
            self.begun += 1
            if index % self.k == 0:
                self._start(step, index)
            while self.steps and self.steps[0]["index"] < self.starts[0].index:
                self._pool.append(self.steps.popleft()["batch"])  # its buffers take the next batches
        reuse = self._pool.pop() if self._pool else None
        self.steps.append({"step": step, "index": index, "rng": rng, "row": None, "groups": None,
                           "batch": _host(batch, reuse, self.pin)})
        self._record_event()

    def _start(self, step: int, index: int) -> None:
        reuse = self.starts[0] if len(self.starts) == 2 else None
        state = {clean_name(k): v for k, v in self.model.state_dict().items()}
        model_state = _host(state, reuse.model_state if reuse else None, self.pin)
        optim = None
        if self.optimizer is not None:
            sd = _host(self.optimizer.state_dict(), reuse.optim["state_dict"] if reuse and reuse.optim else None,
                       self.pin)
            names = [self.names.get(id(p)) for g in self.optimizer.param_groups for p in g["params"]]
            optim = {"class": optimizer_class(self.optimizer), "state_dict": sd, "param_names": names}
        self.starts.append(_Start(step, index, model_state, optim))

    def _record_event(self) -> None:
        if self.pin:
            self._event = torch.cuda.Event()
            self._event.record()

    def _stepping(self, optimizer, args, kwargs) -> None:
        """The optimizer step pre-hook: the step runs, with these hyperparameters."""
        if self.steps and self.steps[-1]["groups"] is None:
            self.steps[-1]["groups"] = [_hyper(g) for g in optimizer.param_groups]

    def end(self, row: dict | None) -> None:
        """``end_step``: the step's trace row (loss, scale, skipped, grad_norm, lr)."""
        if self.steps and row is not None and self.steps[-1]["row"] is None:
            self.steps[-1]["row"] = {k: row.get(k) for k in _ROW}

    def entry(self, step: int, row: dict | None) -> dict | None:
        """The snapshot's ``rewind`` entry (``schema.REWIND_KEYS``) for the current step `step`, or None."""
        if not self.starts or not self.steps or self.steps[-1]["step"] != step:
            return None
        if self._event is not None:
            self._event.synchronize()  # NB: waits for the non_blocking copies: at snapshot time only
        start = self.starts[0]
        kept = [s for s in self.steps if s["index"] >= start.index]
        steps = []
        for i, s in enumerate(kept):
            last = i == len(kept) - 1
            r = s["row"] if s["row"] is not None else ({k: (row or {}).get(k) for k in _ROW} if last else {})
            rng = s["rng"]
            if rng is not None and isinstance(rng.get("cpu"), torch.Generator):
                rng = {**rng, "cpu": rng["cpu"].get_state()}
            steps.append({
                "step": s["step"], "batch": s["batch"], "micro_batches": self.micro.entry(s["batch"]),
                "rng": rng, **{k: r.get(k) for k in _ROW},
                "optimizer_stepped": None if last else s["groups"] is not None,
                "param_groups": _plain_hyper(s["groups"]),
            })
        out = {"steps_asked": self.k, "start_step": start.step, "model_state": start.model_state,
               "optimizer": start.optim, "steps": steps}
        assert tuple(out) == schema.REWIND_KEYS
        return out

    def release(self) -> None:
        """Drop the host copies and the optimizer hook."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.starts.clear()
        self.steps.clear()
        self._pool.clear()

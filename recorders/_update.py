"""What the optimizer step did to the weights: per-layer change columns, the optimizer in files, check_update.

Failures born in the update leave finite gradients and broken or frozen weights:
Adam's ``eps=1e-8`` is 0 in float16, so a zero gradient gives ``0/0``; an update below half an
ulp of a BF16 weight rounds away. This module holds what the Recorder needs to see them:

- ``UpdateSample``: the ``update_rms`` and ``unchanged_frac`` layer columns. A fixed sample of
  each parameter (all elements up to ``SAMPLE``, else ``BLOCKS`` evenly spaced runs of
  contiguous elements; no RNG) is kept on the device and compared with the weights at the next
  recorded layer row: no host sync, a handful of kernels per parameter dtype.
- ``optimizer_meta`` / ``optimizer_entry``: the optimizer's class and hyperparameters for
  meta.json, and its ``state_dict()`` (copied to CPU, ``weights_only``-loadable) for snapshots.
- ``UpdateCheck``: ``check_update=True``'s test after every optimizer step, one fused norm over
  all parameters and one host sync; ``update_entry``: the ``update`` snapshot key.

Example:
    >>> model = torch.nn.Linear(4, 2)
    >>> sample = UpdateSample(list(model.parameters()), torch.device("cpu"))
    >>> sample.measure()[2]    # first call: nothing to compare with yet
    [False, False]
    >>> with torch.no_grad():
    ...     _ = model.weight.add_(1.0)
    >>> rms, unchanged, has = sample.measure()
    >>> rms.tolist(), unchanged.tolist(), has
    ([1.0, 0.0], [0.0, 1.0], [True, True])
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ._norms import norms
from ._stats import local_tensor

__all__ = ["SAMPLE", "BLOCKS", "sample_view", "UpdateSample", "UpdateCheck", "optimizer_class", "optimizer_meta",
           "optimizer_entry", "update_entry"]

SAMPLE = 4096  # elements sampled per parameter for update_rms / unchanged_frac (at most)
BLOCKS = 64    # ... in this many evenly spaced runs of contiguous elements
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-size integer views
_PRIMITIVES = (int, float, str, bool, type(None), torch.dtype, torch.device, torch.Size)


def _blocks(numel: int) -> tuple[int, int, int]:
    """(blocks, block length, step between block starts) of a parameter's sample.

    All elements up to SAMPLE; beyond, BLOCKS evenly spaced runs of SAMPLE // BLOCKS contiguous
    elements. Contiguous runs read whole cache lines: a one-element stride over a large
    embedding touches a new cache line (and often a new page) per element, ~10x slower.
    """
    if numel <= SAMPLE:
        return 1, numel, numel
    return BLOCKS, SAMPLE // BLOCKS, numel // BLOCKS


def sample_view(t: torch.Tensor) -> torch.Tensor:
    """The ``(blocks, length)`` sample of `t` (a view of its storage when `t` is contiguous)."""
    b, n, step = _blocks(t.numel())
    flat = t.reshape(-1)  # NB: a copy only for a non-contiguous parameter
    return flat.as_strided((b, n), (step, 1))


class _Group:
    """Parameters of one device and dtype: their samples are copied into one flat buffer."""

    def __init__(self, tensors: list[torch.Tensor], index: list[int], out: torch.device):
        device, dtype = tensors[0].device, tensors[0].dtype
        self.index = index
        # NB: views of the parameters' own storage, made once: taking them is most of the Python
        # cost. A non-contiguous parameter (reshape copies) is sampled afresh at every call.
        self.static = all(t.is_contiguous() for t in tensors)
        self.views = [sample_view(t) for t in tensors] if self.static else None
        shapes = [_blocks(t.numel())[:2] for t in tensors]
        counts = [b * n for b, n in shapes]
        # two buffers, current and previous, swapped at every call: no allocation per call
        self.bufs = [torch.empty(sum(counts), dtype=dtype, device=device) for _ in range(2)]
        offsets = [sum(counts[:i]) for i in range(len(counts))]
        self.dsts = [[buf[o:o + c].view(shape) for o, c, shape in zip(offsets, counts, shapes)] for buf in self.bufs]
        self.flip = 0
        self.filled = False
        self.work = torch.float64 if dtype == torch.float64 else torch.float32
        self.scratch = torch.empty(sum(counts), dtype=self.work, device=device)  # squares, then matches
        # NB: built once: a host-to-device copy from pageable memory would wait for the device
        self.lengths = torch.tensor(counts, device=device)
        self.seg = torch.repeat_interleave(torch.arange(len(index)), torch.tensor(counts)).to(device)
        self.counts = torch.tensor(counts, dtype=self.work, device=device)
        self.where = torch.tensor(index, dtype=torch.long, device=out)  # positions in the per-parameter output

    def sums(self, x: torch.Tensor) -> torch.Tensor:
        """Per-parameter sums of a flat tensor laid out like the samples."""
        if x.device.type == "cpu":  # segment_reduce is ~2x faster than index_add_ on CPU
            return torch.segment_reduce(x, "sum", lengths=self.lengths, unsafe=True)
        # NB: index_add_ never syncs the host; segment_reduce may check its lengths on the device
        return torch.zeros(len(self.index), dtype=x.dtype, device=x.device).index_add_(0, self.seg, x)


class UpdateSample:
    """Per-parameter change since the previous call, measured on a fixed sample, on the device.

    ``measure()`` returns ``(update_rms, unchanged_frac, has)``: two float32 tensors with one
    entry per parameter, on `device`, and a host list saying which entries are meaningful (a
    floating-point parameter measured before, with the same dtype, size and storage).
    ``update_rms`` is the RMS of ``w_now - w_then`` over the sample (in float32; float64 for
    float64 parameters); ``unchanged_frac`` the fraction of sampled elements whose bits did not
    change. NaN weights give a NaN ``update_rms``.

    NB: the sample (``sample_view``: all elements, or 64 evenly spaced runs of 64) is fixed by
    the size: no random numbers, so training's RNG stream is untouched, and the same elements
    are compared every time.
    """

    def __init__(self, params: list[torch.Tensor], device: torch.device):
        self.params = params
        self.device = device
        # NB: laid out now, at setup: building the groups copies small index tensors to the device,
        # which waits for it. measure() rebuilds only when a parameter's storage is replaced.
        tensors = [local_tensor(p).detach() for p in params]
        self._rebuild(tensors, self._key_of(tensors))

    @staticmethod
    def _key_of(tensors: list[torch.Tensor]) -> tuple:
        return tuple((t.data_ptr(), t.dtype, t.numel()) for t in tensors)  # a new storage: p.data = ...

    def _rebuild(self, tensors: list[torch.Tensor], key: tuple) -> None:
        """Group the floating-point parameters by (device, dtype); every sample starts afresh."""
        by: dict[tuple, list[int]] = {}
        for i, t in enumerate(tensors):
            if t.is_floating_point() and t.numel() and t.element_size() in _BITS:
                by.setdefault((t.device, t.dtype), []).append(i)
        self._groups = [_Group([tensors[i] for i in idx], idx, self.device) for idx in by.values()]
        self._key = key

    def measure(self) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
        """Compare each parameter's sample with the previous call's and keep the new one."""
        n = len(self.params)
        tensors = [local_tensor(p).detach() for p in self.params]
        key = self._key_of(tensors)
        if key != self._key:  # first call, or parameters replaced: start over
            self._rebuild(tensors, key)
        rms = torch.full((n,), float("nan"), dtype=torch.float32, device=self.device)
        same = torch.full((n,), float("nan"), dtype=torch.float32, device=self.device)
        has = [False] * n
        for g in self._groups:
            torch._foreach_copy_(g.dsts[g.flip], g.views if g.static else [sample_view(tensors[i]) for i in g.index])
            cur, prev = g.bufs[g.flip], g.bufs[1 - g.flip]
            if g.filled:
                # NB: into one preallocated buffer: a bool tensor cast to float costs ~3x the comparison
                sq = g.sums(torch.sub(cur.to(g.work), prev.to(g.work), out=g.scratch).square_())
                rms.index_copy_(0, g.where, (sq / g.counts).sqrt().float().to(self.device))
                bits = _BITS[cur.element_size()]
                kept = g.sums(torch.eq(cur.view(bits), prev.view(bits), out=g.scratch))
                same.index_copy_(0, g.where, (kept / g.counts).float().to(self.device))
                for i in g.index:
                    has[i] = True
            g.flip, g.filled = 1 - g.flip, True
        return rms, same, has


class UpdateCheck:
    """``check_update=True``: which parameters are non-finite right after an optimizer step.

    ``nonfinite()`` costs one fused L2 norm over all parameters and one host sync (the scalar
    sum of the norms); only when that is not finite does it look at each parameter (the cold
    path, where a float32 norm that overflowed on finite weights is also told apart).
    """

    def __init__(self, params: list[torch.Tensor], device: torch.device, single_device: bool):
        self.params = params
        self.device = device
        self.single_device = single_device
        self.acc = torch.float32 if device.type == "mps" else torch.float64

    def nonfinite(self) -> list[int]:
        """Indices of the parameters holding a NaN or Inf (``[]`` when all are finite)."""
        tensors = [local_tensor(p).detach() for p in self.params if p.numel()]
        if not tensors:
            return []
        total = norms(tensors, self.device, self.single_device).to(self.acc).sum()
        if math.isfinite(total.item()):  # NB: host sync: check_update's one per optimizer step
            return []
        return [i for i, p in enumerate(self.params)
                if p.numel() and not bool(torch.isfinite(local_tensor(p).detach()).all())]


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """``"torch.optim.adam.Adam"``: module and qualname, a string the analyzer never imports."""
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


_SKIP = object()


def _json_value(v: Any) -> Any:
    """A hyperparameter as JSON (numbers, strings, bools, None, lists of them), or _SKIP."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.is_complex():
            return _SKIP
        v = v.detach().cpu().item()  # a tensor lr (capturable/fused optimizers): setup time only
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v if not isinstance(v, str) or len(v) <= 200 else _SKIP
    if isinstance(v, int):
        return v if abs(v) < 2**63 else _SKIP
    if isinstance(v, float):
        return v if math.isfinite(v) else _SKIP
    if isinstance(v, (list, tuple)) and len(v) <= 16:
        out = [_json_value(x) for x in v]
        return _SKIP if any(x is _SKIP or isinstance(x, list) for x in out) else out
    return _SKIP


def optimizer_meta(optimizer: torch.optim.Optimizer | None, params: list[torch.Tensor]) -> dict | None:
    """meta.json's ``optimizer``: class and, per param group, its JSON-able hyperparameters.

    ``params`` in each group are indices into meta["params"] (`params`, model order); None for
    a tensor the optimizer holds that is not a parameter of the model.
    """
    if optimizer is None:
        return None
    index = {id(p): i for i, p in enumerate(params)}
    groups = []
    for group in optimizer.param_groups:
        entry = {}
        for k, v in group.items():
            if k != "params" and isinstance(k, str) and (jv := _json_value(v)) is not _SKIP:
                entry[k] = jv
        entry["params"] = [index.get(id(p)) for p in group["params"]]
        groups.append(entry)
    return {"class": optimizer_class(optimizer), "param_groups": groups}


def _plain(obj: Any, depth: int = 0) -> Any:
    """A copy holding only what ``torch.load(weights_only=True)`` reads: CPU tensors, containers, primitives.

    Anything else (a callable a custom optimizer keeps in its param groups) becomes its type name
    as a string, so one odd value never makes the snapshot unloadable.
    """
    if isinstance(obj, torch.Tensor):
        return local_tensor(obj).detach().to("cpu", copy=True)
    if isinstance(obj, _PRIMITIVES):
        return obj
    if depth < 32 and isinstance(obj, dict):
        return {(k if isinstance(k, (int, str)) else repr(k)[:200]): _plain(v, depth + 1) for k, v in obj.items()}
    if depth < 32 and isinstance(obj, (list, tuple)):
        items = [_plain(v, depth + 1) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return f"<{type(obj).__module__}.{type(obj).__qualname__}>"


def optimizer_entry(optimizer: torch.optim.Optimizer | None, names: dict[int, str]) -> dict | None:
    """The snapshot's ``optimizer``: class, ``state_dict()`` on CPU, and each param id's model name.

    `names` maps ``id(parameter)`` to its name in the model (``model_state`` keys). The state
    dict numbers parameters 0, 1, ... in param_groups order, so ``param_names[i]`` names id ``i``
    (None for a tensor that is not a parameter of the model).
    """
    if optimizer is None:
        return None
    state = optimizer.state_dict()
    param_names = [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
    return {"class": optimizer_class(optimizer), "state_dict": _plain(state), "param_names": param_names}


def update_entry(model: torch.nn.Module, nonfinite: list[str]) -> dict:
    """The ``update`` snapshot key: this step's gradients as the optimizer used them, the new weights."""
    grads, post = {}, {}
    for name, p in model.named_parameters():
        post[name] = local_tensor(p).detach().to("cpu", copy=True)
        if p.grad is not None:
            g = local_tensor(p.grad).detach()
            grads[name] = (g.to_dense() if g.layout != torch.strided else g).to("cpu", copy=True)
    return {"grads": grads, "post_params": post, "nonfinite_params": list(nonfinite)}

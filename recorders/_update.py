"""What the optimizer step did to the weights: per-layer change columns, the optimizer in files, check_update.

Failures born in the update leave finite gradients and broken or frozen weights:
Adam's ``eps=1e-8`` is 0 in float16, so a zero gradient gives ``0/0``; an update below half an
ulp of a BF16 weight rounds away. This module holds what the Recorder needs to see them:

- ``UpdateSample``: the ``update_rms`` and ``unchanged_frac`` layer columns, and on healthy steps
  ``param_norm`` and ``grad_zero_frac``. A fixed sample of each parameter (all elements up to
  ``SAMPLE``, else ``BLOCKS`` evenly spaced runs of contiguous elements; no RNG) is kept on the
  device and compared with the weights at the next recorded layer row; the same sample of each
  gradient gives its zero fraction: no host sync, a fixed number of kernels per parameter dtype.
  The parameter norm is the sample's, scaled to the whole parameter: exact up to ``SAMPLE``
  elements, an estimate beyond; so is the zero fraction.
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
    >>> rms, unchanged, has, norm, zero_frac = sample.measure([torch.zeros(2, 4), None])
    >>> rms.tolist(), unchanged.tolist(), has
    ([1.0, 0.0], [0.0, 1.0], [True, True])
    >>> zero_frac.tolist()[0]  # the weight's gradient was all zeros; the bias had none given
    1.0
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ._compile import clean_name
from ._norms import norms
from ._stats import local_tensor

__all__ = ["SAMPLE", "BLOCKS", "sample_view", "Measured", "UpdateSample", "UpdateCheck", "optimizer_class", "optimizer_meta",
           "optimizer_entry", "update_entry"]

SAMPLE = 4096  # elements sampled per parameter for update_rms / unchanged_frac (at most)
BLOCKS = 64    # ... in this many evenly spaced runs of contiguous elements
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-size integer views
_PRIMITIVES = (int, float, str, bool, type(None), torch.dtype, torch.device, torch.Size)


def _blocks(numel: int) -> tuple[int, int, int]:
    """(blocks, block length, step between block starts) of a tensor's sample.

    All elements up to SAMPLE; beyond, BLOCKS evenly spaced runs of SAMPLE // BLOCKS contiguous
    elements. Contiguous runs read whole cache lines: a one-element stride over a large
    embedding touches a new cache line (and often a new page) per element, ~10x slower.
    """
    if numel <= SAMPLE:
        return 1, numel, numel
    return BLOCKS, SAMPLE // BLOCKS, numel // BLOCKS


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as one dimension in memory order: a view when `t` is dense in some dim order
    (contiguous, channels_last), else a copy."""
    if t.is_contiguous():
        return t.view(-1)
    dense = t.permute(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return dense.view(-1) if dense.is_contiguous() else t.reshape(-1)


def sample_view(t: torch.Tensor) -> torch.Tensor:
    """The ``(blocks, length)`` sample of `t`, in memory order (a view of its storage when `t` is
    dense: contiguous or channels_last)."""
    b, n, step = _blocks(t.numel())
    return _memory_order(t).as_strided((b, n), (step, 1))


def _width(count: int) -> int:
    """The row width a sample of `count` elements is laid out in: the next power of two."""
    return 1 << max(0, count - 1).bit_length()


class _Group:
    """Parameters of one device and dtype: their samples (and their gradients') in flat buffers.

    Each parameter's sample fills the start of a row of ``_width(count)`` elements; rows of one
    width are contiguous, widest first, so every per-parameter sum is one row sum of a 2-d view
    (``segment_reduce`` measured ~5x slower on CPU). The padding stays zero in every buffer.
    """

    def __init__(self, tensors: list[torch.Tensor], index: list[int], out: torch.device):
        device, dtype = tensors[0].device, tensors[0].dtype
        order = sorted(range(len(index)), key=lambda j: -_width(_blocks(tensors[j].numel())[0] *
                                                               _blocks(tensors[j].numel())[1]))
        tensors = [tensors[j] for j in order]
        self.index = [index[j] for j in order]
        # NB: views of the parameters' own storage, made once: taking them is most of the Python
        # cost. A parameter that is not dense is sampled afresh at every call.
        self.static = all(t.is_contiguous() for t in tensors)
        self.views = [sample_view(t) for t in tensors] if self.static else None
        blocks = [_blocks(t.numel()) for t in tensors]
        shapes = [(b, n) for b, n, _ in blocks]
        self.strided = [((b, n), (step, 1)) for b, n, step in blocks]  # a contiguous gradient's sample
        counts = [b * n for b, n in shapes]
        widths = [_width(c) for c in counts]
        offsets = [sum(widths[:i]) for i in range(len(widths))]
        total = sum(widths)
        self.rows: list[tuple[int, int, int]] = []  # (offset, rows, width) of each width's block
        for w, o in zip(widths, offsets):
            if self.rows and self.rows[-1][2] == w:
                self.rows[-1] = (self.rows[-1][0], self.rows[-1][1] + 1, w)
            else:
                self.rows.append((o, 1, w))
        # three zeroed buffers: the weights' samples now and at the previous call (swapped at
        # every call: no allocation per call), and the gradients'
        self.bufs = [torch.zeros(total, dtype=dtype, device=device) for _ in range(3)]
        self.dsts = [[buf[o:o + c].view(shape) for o, c, shape in zip(offsets, counts, shapes)] for buf in self.bufs]
        self.flip = 0
        self.filled = False
        self.work = torch.float64 if dtype == torch.float64 else torch.float32
        self.bits = _BITS[tensors[0].element_size()]
        # per element: the weight squared, the change squared, bits unchanged, gradient zero
        self.scratch = torch.empty(4, total, dtype=self.work, device=device)
        # NB: built once: a host-to-device copy from pageable memory would wait for the device
        self.counts = torch.tensor(counts, dtype=self.work, device=device)
        self.pad = torch.tensor([w - c for w, c in zip(widths, counts)], dtype=self.work, device=device)
        # sum of squares over the sample -> squared norm of the whole tensor
        self.scale = torch.tensor([t.numel() / c for t, c in zip(tensors, counts)], dtype=self.work, device=device)
        self.where = torch.tensor(self.index, dtype=torch.long, device=out)  # positions in the per-parameter output

    def sums(self) -> torch.Tensor:
        """``(4, tensors)``: each scratch row summed per tensor (padding included)."""
        x = self.scratch
        parts = [x[:, o:o + k * w].view(4, k, w).sum(2) for o, k, w in self.rows]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class Measured(NamedTuple):
    """``UpdateSample.measure()``: per-parameter float32 tensors on the Recorder's device, a host list."""

    rms: torch.Tensor        # update_rms
    unchanged: torch.Tensor  # unchanged_frac
    has: list[bool]          # which rms / unchanged entries are meaningful
    norm: torch.Tensor       # param_norm from the sample; every entry meaningful
    zero_frac: torch.Tensor  # grad_zero_frac from the gradients' sample; NaN where no gradient was given


class UpdateSample:
    """Per-parameter statistics of a layer row, measured on a fixed sample, on the device.

    ``measure(grads)`` returns a ``Measured``, one float32 entry per parameter, on `device`:

    - ``rms``, ``unchanged`` (with ``has``, a host list saying which entries are meaningful: a
      floating-point parameter measured before, with the same dtype, size and storage):
      ``update_rms`` is the RMS of ``w_now - w_then`` over the sample (in float32; float64 for
      float64 parameters), NaN once a sampled weight is NaN; ``unchanged_frac`` the fraction of
      sampled elements whose bits did not change;
    - ``norm``: the L2 norm of the sample scaled by ``sqrt(numel / sampled)``: the parameter's
      norm when it has at most ``SAMPLE`` elements (all are sampled), an estimate beyond; a
      NaN/Inf inside the sample makes it NaN/Inf;
    - ``zero_frac``: the fraction of exact zeros in the same sample of each gradient given
      (``grads[i]`` is parameter ``i``'s, or None): exact up to ``SAMPLE`` elements, an
      estimate beyond (contiguous runs: whole zero rows of an embedding are seen as such, but
      only ``BLOCKS`` rows are looked at). A NaN counts as non-zero.

    Every statistic is one row sum over a few thousand elements per parameter: about 2 x 4096
    elements read per parameter, a fixed number of kernels per parameter dtype, no host sync.

    NB: the sample (``sample_view``: all elements, or 64 evenly spaced runs of 64, in memory
    order) is fixed by the size: no random numbers, so training's RNG stream is untouched, and
    the same elements are compared every time.
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
        grouped = {i for idx in by.values() for i in idx}
        self._others = [i for i in range(len(tensors)) if i not in grouped]  # empty, integer or complex128
        self._key = key

    def measure(self, grads: list[torch.Tensor | None] | None = None) -> Measured:
        """Compare each parameter's sample with the previous call's and keep the new one; sample `grads`."""
        n = len(self.params)
        tensors = [local_tensor(p).detach() for p in self.params]
        key = self._key_of(tensors)
        if key != self._key:  # first call, or parameters replaced: start over
            self._rebuild(tensors, key)
        out = torch.full((4, n), float("nan"), dtype=torch.float32, device=self.device)
        has = [False] * n
        for i in self._others:  # rare: measured whole
            t = tensors[i]
            out[2, i] = torch.linalg.vector_norm(t if t.is_floating_point() or t.is_complex() else t.double()).float()
            if grads is not None and grads[i] is not None and grads[i].numel():
                out[3, i] = 1.0 - torch.count_nonzero(grads[i]) / grads[i].numel()
        for g in self._groups:
            torch._foreach_copy_(g.dsts[g.flip], g.views if g.static else [sample_view(tensors[i]) for i in g.index])
            cur, prev = g.bufs[g.flip], g.bufs[1 - g.flip]
            sq, dsq, kept, zero = g.scratch.unbind(0)
            sq.copy_(cur).square_()  # NB: cast into the preallocated buffer, then squared
            dsq.copy_(cur).sub_(prev).square_()  # (in the work dtype: the old value is promoted)
            # NB: into a preallocated float buffer: a bool tensor cast to float costs ~3x the comparison
            torch.eq(cur.view(g.bits), prev.view(g.bits), out=kept)
            if grads is not None:
                self._sample_grads(g, grads)
                torch.eq(g.bufs[2], 0, out=zero)
            s = g.sums()
            res = torch.stack([(s[1] / g.counts).sqrt_(), (s[2] - g.pad) / g.counts, (s[0] * g.scale).sqrt_(),
                               (s[3] - g.pad) / g.counts if grads is not None else torch.full_like(s[3], math.nan)])
            out.index_copy_(1, g.where, res.float().to(self.device))
            if g.filled:
                for i in g.index:
                    has[i] = True
            else:  # nothing to compare with yet
                out[:2].index_fill_(1, g.where, math.nan)
            g.flip, g.filled = 1 - g.flip, True
        return Measured(out[0], out[1], has, out[2], out[3])

    @staticmethod
    def _sample_grads(g: _Group, grads: list[torch.Tensor | None]) -> None:
        """Copy the gradients' samples into the group's gradient buffer (a missing one: left as it is)."""
        dsts, srcs = [], []
        for i, dst, (size, stride) in zip(g.index, g.dsts[2], g.strided):
            t = grads[i]
            if t is None:
                continue
            dsts.append(dst)
            # NB: gradients are new tensors at every step (zero_grad(set_to_none=True)): views taken afresh
            srcs.append(t.as_strided(size, stride) if t.is_contiguous() else sample_view(t))
        if dsts:
            torch._foreach_copy_(dsts, srcs)


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
        name = clean_name(name)  # a submodule compiled with torch.compile: no _orig_mod. segment
        post[name] = local_tensor(p).detach().to("cpu", copy=True)
        if p.grad is not None:
            g = local_tensor(p.grad).detach()
            grads[name] = (g.to_dense() if g.layout != torch.strided else g).to("cpu", copy=True)
    return {"grads": grads, "post_params": post, "nonfinite_params": list(nonfinite)}

"""Probe ``spike`` and the verdict ``instability``: a loss or gradient spike that FP32 makes too.

A ``loss_spike`` or ``grad_spike`` snapshot carries the recorder's measurement (``spike``: the value, the
trailing baseline and the threshold it crossed). The probe reads the same metric off the replay's runs
(the loss; the total norm of the unscaled gradients) and compares each with that threshold:

- FP32 spikes too: the step's numbers, not its precision, made the spike. The verdict is ``instability``
  (never a precision verdict; the FP32 comparison is not made) and one more FP32 forward measures the
  mechanism: the largest pre-softmax attention logit per module (the input of a softmax over a 3-D or
  larger score tensor, or q.k^T times SDPA's scale, computed from its q and k), the output logits'
  largest value and their log-partition (logsumexp, at the cross-entropy or log-softmax), and the lr
  and gradient norm against the run's trailing median. Advice names the remedy each number points to;
  none is tried on the step, so none is verified.
- FP32 does not spike: what the low precision did is judged by the FP32 comparison
  (``probes/precision.py``): ``precision_error`` when it is beyond tolerance.

NB: the recorder keeps no attention logits. Where the snapshot holds a rewind window (``Recorder(rewind=K)``),
the window is replayed from its start in the run's precision and the top module's logit is measured at each
of its steps (``attention_logit_growth``); without one, the answer says their growth is not recorded.

Real output (the samples' tiny GPT in BF16, logits not divided by sqrt(head_dim), Adam at lr 0.03, recorded with
``rewind=8``)::

    verdict: instability
      The recorded loss spike reproduces in FP32: 1.802 against the trailing baseline 0.5471 (threshold 1.641,
      recorded 1.798), so the low precision did not make it: an instability of the training itself. The largest
      pre-softmax attention logit is 3005, in `blocks.1.attn` (over the rewind window, replayed in bfloat16 as
      training ran it, it went from 2944 at step 272 to 3216 at step 285, x1.092). The output logits reach 15.5, log-partition (logsumexp) up to 15.53 (mean 10.93). lr 0.03 (the trace's
      trailing median 0.03); gradient norm 6.794 against a trailing median of 1.232; weight norm 64.9 against
      59.33; the largest update jump: `blocks.1.ln_1.bias` at step 284, 4.878x its trailing median.
"""
from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from recorders import schema

from ..detection._compare import compare, grad_norm
from ._spike_trace import TraceContext, trace_context
from ..verdicts.registry import AdviceLine, Verdict, register
from .registry import ProbeInput, probe

if TYPE_CHECKING:
    from ..result.diagnosis import Diagnosis

__all__ = ["INSTABILITY", "SpikeCheck", "Mechanism", "spike"]

INSTABILITY = "instability"
_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax}
_PARTITION = {F.cross_entropy, F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax}
QK_LOGIT = 50.0      # an attention logit past this makes softmax nearly one-hot (Wortsman et al. 2023)
LOG_PARTITION = 10.0  # |logsumexp| of the output logits past this: the logits drift (z-loss keeps it near 0)
JUMP = 2.0  # an lr or a layer's update this many times its trailing median is named as a jump


@dataclass
class Mechanism:
    """What one FP32 forward of the step measured (see the module doc); None where the step has none."""

    attention: dict[str, float] = field(default_factory=dict)  # module -> largest |pre-softmax logit|
    logit_absmax: float | None = None
    log_partition_max: float | None = None
    log_partition_mean: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    trace: TraceContext | None = None  # the run's trace over the window before the step
    growth: dict | None = None  # the top attention module's logit over the rewind window (``_logit_growth``)

    @property
    def grad_norm_median(self) -> float | None:
        return None if self.trace is None else self.trace.grad_norm_median

    def top_attention(self) -> tuple[str, float] | None:
        return max(self.attention.items(), key=lambda kv: kv[1]) if self.attention else None

    def to_dict(self) -> dict:
        top = self.top_attention()
        return {"attention_logit_absmax": dict(self.attention),
                "attention_module": None if top is None else top[0],
                "attention_logit_growth": self.growth,  # None without a rewind window (Recorder(rewind=K))
                "output_logit_absmax": self.logit_absmax, "log_partition_max": self.log_partition_max,
                "log_partition_mean": self.log_partition_mean, "lr": self.lr, "grad_norm": self.grad_norm,
                "grad_norm_median": self.grad_norm_median,
                "trace": None if self.trace is None else self.trace.to_dict()}


@dataclass(frozen=True)
class SpikeCheck:
    """The recorded spike against the replayed runs."""

    metric: str
    recorded: float
    baseline: float
    threshold: float
    replayed: dict[str, float | None]
    fp32_spikes: bool
    low_spikes: bool | None
    mechanism: Mechanism | None = None
    # FP32 stays under the threshold, but the recorded precision, which crosses it, is within tolerance of FP32
    # (``_compare``): the two steps are the same step as far as the precision goes
    fp32_within_tolerance: bool = False

    @property
    def instability(self) -> bool:
        """FP32 spikes too, or makes the same step as the spiking low precision within tolerance."""
        return self.fp32_spikes or self.fp32_within_tolerance

    def to_dict(self) -> dict:
        return {"spike": {"metric": self.metric, "recorded": self.recorded, "baseline": self.baseline,
                          "threshold": self.threshold, "replayed": dict(self.replayed),
                          "fp32_spikes": self.fp32_spikes, "low_spikes": self.low_spikes,
                          "fp32_within_tolerance": self.fp32_within_tolerance,
                          "mechanism": None if self.mechanism is None else self.mechanism.to_dict()}}


class _Observe(TorchFunctionMode):
    """Records attention logits and output-logit partitions of one forward (a ``Mechanism``)."""

    def __init__(self, found: Mechanism, where: list[str]):
        super().__init__()
        self.found, self.where = found, where
        self._lse: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch._C._current_graph_task_id() != -1 or not args or not isinstance(args[0], torch.Tensor):
            return out
        x = args[0].detach()
        with torch.no_grad():
            if func in _SOFTMAX and x.dim() >= 3:
                v = x.float().abs()
                self._attention(torch.where(torch.isfinite(v), v, 0).max())  # a -inf mask is no logit
            elif func is F.scaled_dot_product_attention and len(args) >= 2:
                q, k = x.float(), args[1].detach().float()
                scale = kwargs.get("scale") or 1.0 / math.sqrt(q.shape[-1])
                self._attention((q @ k.transpose(-2, -1) * scale).abs().max())
            elif func in _PARTITION and x.is_floating_point() and x.dim() >= 1:
                dim = 1 if func is F.cross_entropy and x.dim() > 1 else kwargs.get("dim", args[1] if len(args) > 1
                                                                                   and isinstance(args[1], int) else -1)
                self._lse.append(torch.logsumexp(x.float(), dim=dim).flatten())
                m = float(x.float().abs().max())  # NB: host read; this forward is a diagnosis
                self.found.logit_absmax = m if self.found.logit_absmax is None else max(m, self.found.logit_absmax)
        return out

    def _attention(self, v: torch.Tensor) -> None:
        name = self.where[-1] if self.where else "<model>"
        self.found.attention[name] = max(float(v), self.found.attention.get(name, 0.0))

    def finish(self) -> None:
        if self._lse:
            lse = torch.cat(self._lse)
            self.found.log_partition_max = float(lse.abs().max())
            self.found.log_partition_mean = float(lse.mean())


@contextmanager
def _observing(model: torch.nn.Module, found: Mechanism):
    where: list[str] = []
    handles = []

    def leave(_m, _a, _o) -> None:  # returns None: a forward hook's return value would replace the output
        if where:
            where.pop()

    for name, m in model.named_modules():
        handles.append(m.register_forward_pre_hook(lambda _m, _a, n=name: where.append(n or "<model>") and None))
        handles.append(m.register_forward_hook(leave, always_call=True))
    mode = _Observe(found, where)
    try:
        with ExitStack() as stack:
            stack.enter_context(mode)
            yield
    finally:
        for h in handles:
            h.remove()
        mode.finish()


_MAX_WINDOW = 1_000_000  # trailing steps read for the median gradient norm, at most


def _num(v: Any) -> float | None:
    """A finite number of the snapshot's spike entry, else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:  # an int beyond float's range
        return None
    return f if math.isfinite(f) else None


def _metric(run, metric: str) -> float | None:
    if run is None:
        return None
    return run.loss if metric == "loss" else grad_norm(run)


def _lr(snapshot) -> float | None:
    opt = getattr(snapshot, "optimizer", None)
    groups = ((opt or {}).get("state_dict") or {}).get("param_groups") if isinstance(opt, dict) else None
    lr = groups[0].get("lr") if groups and isinstance(groups[0], dict) else None
    return float(lr) if isinstance(lr, (int, float)) else None


def _spiking(d: Diagnosis) -> bool:
    return d.verdict == "healthy"


@probe("spike", when=_spiking, into="result")
def spike(inp: ProbeInput) -> SpikeCheck | None:
    snap = inp.snapshot
    sp = getattr(snap, "spike", None)
    if snap.reason not in (schema.LOSS_SPIKE, schema.GRAD_SPIKE) or not isinstance(sp, dict):
        return None
    metric, threshold = sp.get("metric"), _num(sp.get("threshold"))
    value, baseline = _num(sp.get("value")), _num(sp.get("baseline"))
    if metric not in ("loss", "grad_norm") or threshold is None or value is None or baseline is None:
        return None  # not the recorder's measurement (the loader keeps any numbers and short texts): nothing to judge
    window = sp.get("window")
    window = window if isinstance(window, int) and not isinstance(window, bool) and 0 < window <= _MAX_WINDOW else 100
    low = inp.diagnosis.low
    replayed = {p: _metric(r, metric) for p, r in inp.runs.items()}
    fp32 = replayed.get("float32")
    fp32_spikes = fp32 is not None and fp32 > threshold
    low_v = replayed.get(low or "float32")  # the recorded precision's replay (FP32 for a run without AMP)
    low_spikes = None if low_v is None else low_v > threshold
    near = False
    if low_spikes and not fp32_spikes and low in inp.runs:
        c = compare(inp.runs[low], inp.runs["float32"])
        near = c is not None and not c.beyond
    mech = None
    if fp32_spikes or near:
        from ..runs._runs import run_once

        mech = Mechanism(lr=_lr(snap), grad_norm=grad_norm(inp.runs["float32"]),
                         trace=trace_context(inp.path, snap.step, snap.rank, window))
        run_once(inp.ctx, "float32", 1.0, prepare=lambda model: _observing(model, mech))
        top, rw = mech.top_attention(), getattr(snap, "rewind", None)
        if top is not None and isinstance(rw, dict):
            mech.growth = _logit_growth(inp, rw, top[0])
    return SpikeCheck(metric, value, baseline, threshold, replayed, fp32_spikes, low_spikes, mech, near)


def _logit_growth(inp: ProbeInput, rw: dict, module: str) -> dict:
    """`module`'s largest pre-softmax logit at each step of the snapshot's rewind window, the window replayed
    from its start in the run's precision as training ran it (``window/_trajectory``): K more steps' cost."""
    from ...errors import AnalyzerError
    from ..window._trajectory import run_trajectory

    ctx, per_step = inp.ctx, []
    precision = ctx.mode.dtype or "float32"

    @contextmanager
    def observe(model, _step):
        found = Mechanism()
        with _observing(model, found):
            yield
        per_step.append(found.attention.get(module))

    saved, fork = ctx.model_state, [ctx.device.index or 0] if ctx.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=fork):  # the caller's RNG is left as it was
            run_trajectory(ctx, rw["model_state"], rw["optimizer"], rw["steps"], precision,
                           bool(getattr(inp.snapshot, "has_scaler", False)), observe=observe)
    except AnalyzerError as e:  # e.g. an optimizer the window cannot rebuild: said, not raised
        return {"module": module, "error": e.message}
    finally:
        ctx.model_state = saved  # the snapshot's own step, for every run after this one
    steps = [s["step"] for s in rw["steps"]][:len(per_step)]
    first, last = (per_step[0], per_step[-1]) if per_step else (None, None)
    factor = last / first if first and last is not None else None
    return {"module": module, "precision": precision, "steps": steps, "logits": per_step, "first": first,
            "last": last, "factor": factor}


# -- the verdict ------------------------------------------------------------------------------------
def _g(v: Any) -> str:
    return "?" if v is None else f"{v:.4g}"


def _summary(d: Diagnosis) -> str:
    s: SpikeCheck = d.evidence["spike"]
    what = "loss" if s.metric == "loss" else "total gradient norm"
    if s.fp32_spikes:
        text = (f"The recorded {what} spike reproduces in FP32: {_g(s.replayed.get('float32'))} against the trailing "
                f"baseline {_g(s.baseline)} (threshold {_g(s.threshold)}, recorded {_g(s.recorded)}), so the low "
                "precision did not make it: an instability of the training itself.")
    else:
        low = next((p for p in s.replayed if p != "float32"), "float32")
        text = (f"The recorded {what} spike reproduces in {low} ({_g(s.replayed.get(low))} against the trailing "
                f"baseline {_g(s.baseline)}, threshold {_g(s.threshold)}); FP32 gives {_g(s.replayed.get('float32'))}, "
                "just under the threshold but within the precision tolerance of that step (fp32_comparison's "
                "bounds), so the low precision did not make it: an instability of the training itself.")
    m = s.mechanism
    if m is None:
        return text
    top = m.top_attention()
    if top is not None:
        text += f" The largest pre-softmax attention logit is {_g(top[1])}, in `{top[0]}` ({_growth_words(m.growth)})."
    if m.logit_absmax is not None:
        text += (f" The output logits reach {_g(m.logit_absmax)}, log-partition (logsumexp) up to "
                 f"{_g(m.log_partition_max)} (mean {_g(m.log_partition_mean)}).")
    t = m.trace or TraceContext()
    facts = [] if m.lr is None else [f"lr {_g(m.lr)}" + (f" (the trace's trailing median {_g(t.lr_median)})"
                                                         if t.lr_median is not None else "")]
    if t.grad_norm_median is not None:
        facts.append(f"gradient norm {_g(m.grad_norm)} against a trailing median of {_g(t.grad_norm_median)}")
    if t.weight_norm is not None and t.weight_norm_median is not None:
        facts.append(f"weight norm {_g(t.weight_norm)} against {_g(t.weight_norm_median)}")
    if t.update_layer is not None and t.update_ratio > JUMP:
        facts.append(f"the largest update jump: `{t.update_layer}` at step {t.update_step}, {_g(t.update_ratio)}x "
                     "its trailing median")
    return text + (f" {'; '.join(facts)}." if facts else "")


def _growth_words(g: dict | None) -> str:
    if g is None:
        return "its growth over earlier steps is not recorded: Recorder(rewind=K) keeps the steps to measure it"
    if g.get("error"):
        return f"its growth over the rewind window could not be measured: {g['error']}"
    return (f"over the rewind window, replayed in {g['precision']} as training ran it, it went from {_g(g['first'])} "
            f"at step {g['steps'][0]} to {_g(g['last'])} at step {g['steps'][-1]}, x{_g(g['factor'])}")


def _advice(d: Diagnosis) -> list[AdviceLine]:
    s: SpikeCheck = d.evidence["spike"]
    m = s.mechanism or Mechanism()
    out = []
    top = m.top_attention()
    if top is not None and top[1] > QK_LOGIT:
        out.append(AdviceLine(f"Add QK-layernorm (a LayerNorm on q and on k per head, before q.k^T) in `{top[0]}`: its "
                              f"attention logits reach {top[1]:.3g}, where softmax is one-hot and attention collapses."))
    if m.log_partition_max is not None and m.log_partition_max > LOG_PARTITION:
        out.append(AdviceLine(f"Add a z-loss, 1e-4 * logsumexp(logits)**2 averaged over tokens: the log-partition "
                              f"reaches {m.log_partition_max:.3g} and the output logits {_g(m.logit_absmax)}."))
    lr = f" (lr {_g(m.lr)})" if m.lr is not None else ""
    t = m.trace or TraceContext()
    if m.lr is not None and t.lr_median and m.lr > JUMP * t.lr_median:
        out.append(AdviceLine(f"The lr is {_g(m.lr)}, {m.lr / t.lr_median:.3g}x its trailing median {_g(t.lr_median)}: "
                              "check the scheduler (a jump, a restart without warm-up)."))
    out.append(AdviceLine(f"Warm the learning rate up or lower it{lr}: the step spikes in FP32 too."))
    if m.grad_norm_median is not None:
        out.append(AdviceLine(f"Clip the gradient norm near its usual size, clip_grad_norm_(params, "
                              f"{m.grad_norm_median:.3g}): this step's is {_g(m.grad_norm)}."))
    return out


register(Verdict(
    INSTABILITY, "A loss or gradient spike that the FP32 replay of the step makes too: the training's dynamics, "
    "not its precision; the mechanism measured on the step is named.",
    summary=_summary, advice=_advice, refines=("healthy",),
    detect=lambda d: "spike" in d.evidence and d.evidence["spike"].instability))

"""Probes ``random_draws`` and ``reproduction``, and the verdict ``not_reproduced`` they make possible.

A replay that finds every precision finite is ``healthy`` only when it replayed the step that failed.
Two things say it did not:

- ``reproduction``: the recorder saw the step fail (a NaN/Inf loss, or NaN/Inf gradients; not a
  ``peer_failure`` snapshot, whose rank the recorder already knew to be healthy), and the
  replay in the recorded precision, with the recorded RNG state, device type and loss scale, is
  finite. What is left is nondeterminism (atomics, another kernel, another device's autocast policy)
  or a transient hardware fault (silent data corruption, a bad memory page): the question large runs
  ask first about a NaN (Megatron-LM's rerun state machine re-runs the step to tell them apart).
- ``random_draws``: the step draws random numbers (dropout, a noise level drawn inside the loss, ...)
  and no RNG state came with the checkpoint and batch: they ran from a fixed seed, so the replayed
  draws are not the failing step's. The evidence names the draws (op, module, source line).

Either makes the verdict ``not_reproduced`` instead of ``healthy``; its summary shows the recorded and
the replayed losses, and its advice says what to do (replay on another device, compare the ranks, save
the RNG state). A compiled snapshot is left to the compiled re-run (``compiled/``), which replays the
step as training compiled it before anything is concluded.

Real output (a denoiser whose loss draws its noise level, replayed from a checkpoint and batch saved
without the RNG state)::

    verdict: not_reproduced
      Every replayed precision is finite, but the step draws random numbers (aten.randn in <loss_fn> at
      tests/analyzer/replay/denoiser_models.py:39, forward; aten.randn_like in <loss_fn> at
      tests/analyzer/replay/denoiser_models.py:40, forward) and no RNG state was given: they ran from a
      fixed seed (0), so this replay need not be the step that failed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from recorders import schema

from ..verdicts.registry import AdviceLine, Verdict, register
from .registry import ProbeInput, probe

if TYPE_CHECKING:
    from ..result.diagnosis import Diagnosis

__all__ = ["NOT_REPRODUCED", "RNG_OPS", "RandomDraws", "Reproduction", "random_draws", "reproduction"]

NOT_REPRODUCED = "not_reproduced"
# ATen ops that draw from a generator (their names without the "aten." namespace)
RNG_OPS = frozenset({
    "normal", "normal_", "uniform", "uniform_", "bernoulli", "bernoulli_", "native_dropout", "_fused_dropout",
    "dropout", "feature_dropout", "alpha_dropout", "rand", "rand_like", "randn", "randn_like", "randint",
    "randint_like", "randperm", "multinomial", "exponential_", "geometric_", "log_normal_", "cauchy_", "random_",
    "poisson", "binomial", "rrelu_with_noise", "_standard_gamma", "_sample_dirichlet",
})
_MAX_DRAWS = 3  # the draws named; the count says how many ops drew


def _draws(trace) -> tuple[list[dict[str, Any]], int]:
    """The first distinct random draws of a run (op, module, source, phase) and how many ops drew."""
    seen, out, count = set(), [], 0
    for rec in trace.records:
        ns, _, name = rec.name.partition(".")
        if ns != "aten" or name not in RNG_OPS:
            continue
        count += 1
        key = (rec.name, rec.module, rec.source)
        if key not in seen and len(out) < _MAX_DRAWS:
            seen.add(key)
            out.append({"op": rec.name, "module": rec.module, "source": rec.source, "phase": rec.phase})
    return out, count


def _where(draw: dict) -> str:
    src = f" at {draw['source']}" if draw.get("source") else ""
    return f"{draw['op']} in {draw['module']}{src}, {draw['phase']}"


def _fixed_seed(snapshot) -> int | None:
    """The fixed seed a checkpoint replay drew from, or None when the step's RNG state was given."""
    source = getattr(snapshot, "source", None)  # a checkpoint and batch (load.adhoc); a snapshot has none
    return source.get("seed") if isinstance(source, dict) else None


def _healthy(d: Diagnosis) -> bool:
    return d.verdict == "healthy"


@dataclass(frozen=True)
class RandomDraws:
    """The random draws of a step replayed without its RNG state."""

    draws: tuple[dict[str, Any], ...]
    count: int
    seed: int

    def to_dict(self) -> dict:
        return {"random_draws": {"draws": [dict(d) for d in self.draws], "ops": self.count, "seed": self.seed,
                                 "rng_state": None}}


@probe("random_draws", when=_healthy, into="result")
def random_draws(inp: ProbeInput) -> RandomDraws | None:
    seed = _fixed_seed(inp.snapshot)
    if seed is None or getattr(inp.snapshot, "compile", None):
        return None
    trace = inp.runs.get(inp.ctx.mode.dtype or "float32") or next(iter(inp.runs.values()))
    draws, count = _draws(trace)
    return RandomDraws(tuple(draws), count, seed) if draws else None


@dataclass(frozen=True)
class Reproduction:
    """A recorded failure that the replay in the recorded precision did not reproduce."""

    failed: str                 # what the recorder saw: "a NaN/Inf loss" or "NaN/Inf gradients"
    recorded_loss: float | None
    precision: str
    replayed: dict[str, float]  # per replayed precision, its loss
    scale: float
    device: str
    recorded_device: str | None
    sharded: bool               # the step ran on several ranks: this replay runs no collective
    spike: dict | None = None   # a spike snapshot: per replayed precision, its value of the spiking metric
    fsdp_world: int | None = None   # an FSDP2 snapshot with a DCP directory: its rank count (the distributed replay)
    reduce_dtype: str | None = None  # its policy's reduce_dtype (DDP: its comm hook's; None: the gradients' own)
    ddp_hook: str | None = None  # a DDP snapshot (format 9) the distributed replay can reduce: its comm hook, or "reducer"

    @property
    def command(self) -> str | None:
        """The distributed replay that runs the step's collectives, for an FSDP2 or DDP snapshot that can have it."""
        return None if self.fsdp_world is None else \
            f"torchrun --nproc-per-node {self.fsdp_world} -m analyzer replay SNAPSHOT"

    def to_dict(self) -> dict:
        rec = self.recorded_loss
        out = {**({"spike_replayed": dict(self.spike)} if self.spike is not None else {}),
            "recorded": self.failed, "recorded_loss": rec if rec is None or math.isfinite(rec) else str(rec),
            "precision": self.precision, "replayed_loss": dict(self.replayed), "scale": self.scale,
            "device": self.device, "recorded_device": self.recorded_device, "collectives_replayed": not self.sharded}
        if self.command is not None:
            out["distributed_replay"] = self.command
        return {"not_reproduced": out}


def _recorded_failure(snap) -> str | None:
    if snap.reason == schema.PEER_FAILURE:  # the recorder knew: another rank failed; this one replays finite
        return None
    loss = snap.loss
    if isinstance(loss, (int, float)) and not math.isfinite(loss):
        return "a NaN/Inf loss"
    if snap.reason == schema.NONFINITE_GRADS or (isinstance(snap.grad_norm, (int, float))
                                                 and not math.isfinite(snap.grad_norm)):
        return "NaN/Inf gradients"
    return None


@probe("reproduction", when=_healthy, into="result")
def reproduction(inp: ProbeInput) -> Reproduction | None:
    snap = inp.snapshot
    failed = _recorded_failure(snap)
    sp = inp.diagnosis.evidence.get("spike")  # probes/spike.py: a spike the recorded precision's replay stays under
    spiked = failed is None and sp is not None and sp.low_spikes is False and not sp.fp32_spikes
    if spiked:
        what = "loss" if sp.metric == "loss" else "gradient-norm"
        failed = (f"a {what} spike ({_g(sp.recorded)} against a trailing baseline of {_g(sp.baseline)}, threshold "
                  f"{_g(sp.threshold)})")
    if failed is None or getattr(snap, "compile", None):
        return None
    prec = inp.ctx.mode.dtype or "float32"
    run = inp.runs.get(prec)
    if run is None or not run.finite:
        return None
    fsdp = getattr(snap, "fsdp", None)
    sharded = bool(fsdp) or (isinstance(snap.world_size, int) and snap.world_size > 1)
    world = fsdp.get("world_size") if isinstance(fsdp, dict) and fsdp.get("dcp_dir") else None
    policy = fsdp.get("mp_policy") if isinstance(fsdp, dict) else None
    reduce_dtype = policy.get("reduce_dtype") if isinstance(policy, dict) else None
    ddp, hook = getattr(snap, "ddp", None), None
    if not fsdp and isinstance(ddp, dict) and ddp.get("comm_hook") != "unknown" and ddp.get("divide") == "before" \
            and ddp.get("mixed_precision") is None:  # what the distributed replay can reduce (distributed/replicated.py)
        world, reduce_dtype, hook = ddp.get("world_size") or snap.world_size, ddp.get("reduce_dtype"), \
            ddp.get("comm_hook") or "reducer"
    return Reproduction(failed, snap.loss if isinstance(snap.loss, (int, float)) else None, prec,
                        {p: r.loss for p, r in inp.runs.items()}, inp.diagnosis.scale, str(inp.ctx.device.type),
                        snap.device_type, sharded, sp.replayed if spiked else None,
                        world if isinstance(world, int) and world > 1 else None, reduce_dtype, hook)


def _g(x: float) -> str:
    return f"{x:.6g}"


def _summary(d: Diagnosis) -> str:
    parts = []
    rep: Reproduction | None = d.evidence.get("reproduction")
    draws: RandomDraws | None = d.evidence.get("random_draws")
    if rep is not None:
        loss = "" if rep.recorded_loss is None else f" (loss {rep.recorded_loss})"
        replayed = ", ".join(f"{p} {_g(v)}" for p, v in rep.replayed.items())
        if rep.spike is not None:
            values = ", ".join(f"{p} {_g(v)}" for p, v in rep.spike.items() if v is not None)
            parts.append(
                f"The recorder saw {rep.failed} at this step, but its replay in {rep.precision} on {rep.device}, with "
                f"the recorded RNG state and loss scale {_g(rep.scale)}, stays under the threshold, and so does FP32 "
                f"({values}): the spike did not reproduce. Nondeterminism (atomics, another kernel or device) or a "
                "transient hardware fault made it, not this step's numerics as replayed.")
            rep = None
    if rep is not None:
        parts.append(
            f"The recorder saw this step fail with {rep.failed}{loss}, but its replay in {rep.precision} on "
            f"{rep.device}, with the recorded RNG state and loss scale {_g(rep.scale)}, is finite (losses: "
            f"{replayed}): the failure did not reproduce.")
        if rep.command is not None:  # FSDP2 or DDP: the collectives are the first suspect, and they can be replayed
            how = (f"FSDP2 reduced the gradients in {rep.reduce_dtype or 'the parameters dtype'}" if rep.ddp_hook is None
                   else f"DDP's {'own all-reduce' if rep.ddp_hook == 'reducer' else rep.ddp_hook} reduced the gradients "
                        f"in {rep.reduce_dtype or 'their own dtype'}")
            parts.append(
                f"This one-process replay cannot see the collectives of the {rep.fsdp_world} ranks ({how} "
                f"across them): a failure born in a "
                f"reduction, or brought in by one, is not replayed here. Replay the step with its collectives: "
                f"{rep.command}.")
        else:
            parts.append("Nondeterminism (atomics, another kernel or device) or a transient hardware fault (silent "
                         "data corruption, a bad memory page) made it, not this step's numerics as replayed.")
        if rep.recorded_device and rep.recorded_device != rep.device:
            parts.append(f"NB: the step ran on {rep.recorded_device} in training and on {rep.device} here.")
        if rep.sharded and rep.command is None:
            parts.append("NB: the step ran on several ranks and this one-process replay runs none of their "
                         "collectives: NaN/Inf that reached this rank through a gradient reduction from another "
                         "rank is not replayed here.")
    if draws is not None:
        named = "; ".join(_where(x) for x in draws.draws)
        more = f", {draws.count} draws in all" if draws.count > len(draws.draws) else ""
        lead = "Every replayed precision is finite, but the step" if rep is None else "The step also"
        parts.append(f"{lead} draws random numbers ({named}{more}) and no RNG state was given: they ran from a "
                     f"fixed seed ({draws.seed}), so this replay need not be the step that failed.")
    return " ".join(parts)


def _advice(d: Diagnosis) -> list[AdviceLine]:
    lines = []
    if "random_draws" in d.evidence:
        lines.append(AdviceLine(
            "Save the step's RNG state with its batch, at the step's start: torch.save({'batch': batch, 'rng': "
            "{'cpu': torch.get_rng_state(), 'cuda': torch.cuda.get_rng_state_all() if torch.cuda.is_available() "
            "else None}}, 'batch.pt') (or pass the state as --rng FILE), then replay again."))
    rep: Reproduction | None = d.evidence.get("reproduction")
    if rep is not None and rep.command is not None:
        lines.append(AdviceLine(f"Replay the step on {rep.fsdp_world} processes, collectives included: {rep.command} "
                                "(docs/distributed.md)."))
    if rep is not None:
        other = "cpu" if rep.device != "cpu" else "cuda"
        lines.append(AdviceLine(
            f"Replay on another device (--device {other}) and, where it can, on the kind it ran on: a failure "
            "that returns there is that device's nondeterminism; one that returns nowhere was transient."))
        lines.append(AdviceLine(
            "Compare the ranks and steps with `analyzer report` on the run directory: a rank or host that fails "
            "again while the others do not (repeated_rank_failure) points to its hardware."))
    return lines


register(Verdict(
    NOT_REPRODUCED, "The replay did not reproduce the failing step: the recorder saw it fail but the replay in "
    "the recorded precision is finite, or the step draws random numbers whose state was not given.",
    summary=_summary, advice=_advice, refines=("healthy",),
    detect=lambda d: "reproduction" in d.evidence or "random_draws" in d.evidence))

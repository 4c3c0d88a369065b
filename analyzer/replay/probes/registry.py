"""The probe registry: each kind of evidence a replay gathers around its diagnosis, found by name.

A probe is a function of one ``ProbeInput`` (the snapshot, the rebuilt model, the precision runs
and the base ``Diagnosis``) that returns a frozen evidence value, or None when it finds nothing.
It is registered beside its definition with ``@probe(name, when=..., into=...)``:

- ``when(diagnosis)``: whether the probe applies at all (it is not called otherwise);
- ``into``: where its evidence goes in ``replay --json``: ``"culprit"`` (each key of the
  evidence's ``to_dict()`` becomes a field of the culprit: a ``Culprit`` field), ``"result"``
  (each key becomes a top-level key) or None (read by the verdict's summary and advice only).

An evidence value has ``to_dict()`` and, where it has one, ``note()``: a sentence the summary
ends with (``verdicts.summary`` adds the notes in probe order). The verdicts' summaries, advice
and ``detect`` read evidence from ``Diagnosis.evidence`` by the probe's name; nothing patches a
summary afterwards. Probes run after detection and before ``verdicts.refine``.

Probes run in ``ORDER`` (this file: the one list that says it), then any probe not listed, in
the order registered, whatever order their modules are imported in. A probe's evidence is in
the ``Diagnosis`` the next probe reads.

Example (one module; importing it registers the probe; the whole of it, with a verdict that rests
on it, is ``tests/analyzer/replay/log_zeros_probe.py``):

    >>> @probe("log_zeros", when=lambda d: d.verdict == "numerical_bug", into="result")
    ... def log_zeros(inp: ProbeInput) -> LogZeros | None:
    ...     x = inp.diagnosis.trace.captured[0][0]                    # doctest: +SKIP
    ...     return LogZeros(int((x == 0).sum()), x.numel())          # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..verdicts.registry import in_order

if TYPE_CHECKING:
    from ...load import Snapshot
    from ..runs._runs import ReplayContext
    from ..result.diagnosis import Diagnosis
    from ..result.trace import RunTrace

__all__ = ["ORDER", "PROBES", "Evidence", "Probe", "ProbeInput", "probe", "run_probes", "spread"]

# The order probes run in, and so the order of their notes in the summary and of their fields in the JSON.
# compiled last: the compiled re-run is compared with the eager verdict every other probe's evidence refines.
ORDER = ("batch_fault", "micro_batch", "magnitude_jump", "small_input", "sqrt_d", "outside_writes", "autocast_off", "fp8",
         "random_draws", "spike", "fp32_comparison", "reproduction", "compiled")
_INTO = ("culprit", "result", None)


class Evidence(Protocol):
    """What a probe returns: a frozen value with its JSON fields (and, optionally, ``note()``)."""

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ProbeInput:
    """What a probe reads: the snapshot, the rebuilt model and its runs, and the diagnosis so far.

    Attributes:
        path: the snapshot's path.
        snapshot: the loaded ``Snapshot``.
        ctx: the rebuilt model, batch and RNG (``_runs.ReplayContext``); a probe may re-run the step.
        runs: per precision, its run at the recorded loss scale.
        diagnosis: the base ``Diagnosis``, with the evidence of the probes that ran before.
    """

    path: str
    snapshot: Snapshot
    ctx: ReplayContext
    runs: Mapping[str, RunTrace]
    diagnosis: Diagnosis


@dataclass(frozen=True)
class Probe:
    """One registered probe (see the module doc)."""

    name: str
    run: Callable[[ProbeInput], Evidence | None]
    when: Callable[[Diagnosis], bool]
    into: str | None = None

    def __post_init__(self):
        if self.into not in _INTO:
            raise ValueError(f"probe {self.name!r}: into must be one of {_INTO}, got {self.into!r}")


PROBES: dict[str, Probe] = {}


def probe(name: str, *, when: Callable[[Diagnosis], bool] = lambda _d: True,
          into: str | None = None) -> Callable[[Callable], Callable]:
    """Register the decorated function as the probe `name` (a name already there is refused)."""
    def register(fn: Callable[[ProbeInput], Evidence | None]) -> Callable[[ProbeInput], Evidence | None]:
        if name in PROBES:
            raise ValueError(f"probe {name!r} is already registered")
        PROBES[name] = Probe(name, fn, when, into)
        in_order(PROBES, ORDER)
        return fn
    return register


def _ordered() -> list[Probe]:
    return list(PROBES.values())  # kept in ORDER by ``probe``


def run_probes(path: str, snapshot: Snapshot, ctx: ReplayContext, runs: Mapping[str, RunTrace],
               diagnosis: Diagnosis) -> Diagnosis:
    """`diagnosis` with the evidence of every probe that applies, in order (``Diagnosis.evidence``)."""
    d = diagnosis
    for p in _ordered():
        if not p.when(d):
            continue
        ev = p.run(ProbeInput(path, snapshot, ctx, runs, d))
        if ev is not None:
            d = dataclasses.replace(d, evidence={**d.evidence, p.name: ev})
    return d


def spread(evidence: Mapping[str, Evidence], into: str) -> dict[str, Any]:
    """The JSON fields of every evidence that goes `into` the culprit or the result, in probe order
    (``run_probes`` adds the evidence in that order)."""
    out: dict[str, Any] = {}
    for name in evidence:
        p = PROBES.get(name)
        if p is not None and p.into == into:
            out.update(evidence[name].to_dict())
    return out

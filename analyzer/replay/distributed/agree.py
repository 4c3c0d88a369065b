"""What the ranks agree on: each rank's run summarised on the host, then one verdict from every rank's summary.

A rank's run of the step (``RunTrace``) becomes a small summary (``summarize``): loss, finiteness, its first
op with a non-finite output, its first op reading a non-finite value that no op of the step made, and
every collective with its input and output abs-max. The summaries of every rank are all-gathered, and
``decide`` is a pure function of them, so every rank reaches the same verdict and plans the same fix runs.

A rank's first op is where a NaN/Inf is born: a non-finite output from finite inputs. The culprit is the
earliest op in the step's order, then the lowest rank: ranks run the same ops in the
same order under FSDP2, so op indices line up. FSDP2's own copies and the collectives are never the
culprit of a value that was already non-finite where it came from; a collective is the culprit only
when every rank's input to it is finite and its output is not on some rank: a sum in ``reduce_dtype``
that left the range.

Example:
    >>> d = decide({"float32": fp32_summaries, "float16": fp16_summaries}, "float16", bad_inputs=[])  # doctest: +SKIP
    >>> d.verdict, d.culprit["op"], [r["input_absmax"] for r in d.culprit["collective"]["ranks"]]  # doctest: +SKIP
    ('overflow', 'c10d._reduce_scatter_base_', [40256.0, 40256.0])
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..result.trace import RunTrace
from .sharded import is_collective, is_plumbing

__all__ = ["summarize", "decide", "Decision", "DISTRIBUTED_VERDICTS", "UNINITIALISED"]

# The verdicts the distributed replay gives (a subset of the one-process replay's, plus ``not_classified``:
# a low-precision culprit whose class needs the one-process replay's shadow and flush checks).
DISTRIBUTED_VERDICTS = ("healthy", "nonfinite_input", "numerical_bug", "overflow", "not_classified")


# Ops whose output is uninitialised memory (FSDP2 allocates its buffers so): what they hold is no value.
UNINITIALISED = frozenset({"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
                            "aten.new_empty_strided", "aten.empty_permuted"})


def _nan_max(vals: list[float]) -> float | None:
    if not vals:
        return None
    return math.nan if any(math.isnan(v) for v in vals) else max(vals)


def _finite(v: float | None) -> bool:
    return v is None or math.isfinite(v)


def _op(run: RunTrace, i: int) -> dict[str, Any]:
    rec = run.records[i]
    return {"op": rec.name, "overload": rec.overload, "module": rec.module, "phase": rec.phase,
            "index": rec.index, "source": rec.source, "precision": run.precision,
            "input_dtypes": sorted(str(d).removeprefix("torch.") for d in rec.in_dtypes),
            "output_dtype": None if rec.out_dtype is None else str(rec.out_dtype).removeprefix("torch."),
            "input_absmax": _nan_max([run.absmax[s] for s, _ in rec.inputs]),
            "output_absmax": _nan_max([run.absmax[s] for s in rec.outputs])}


def summarize(run: RunTrace, modules: dict[int, str] | None = None, fsdp_ops: set[int] | None = None,
              sources: dict[int, int] | None = None, groups: dict[int, tuple[int, ...]] | None = None
              ) -> dict[str, Any]:
    """This rank's run as small host values (picklable; the all-gather sends them).

    `modules`: op index of a collective -> the sharded module (or DDP: the parameter) whose values it moved;
    `fsdp_ops`: the ops FSDP2 or the replay's DDP hook ran around the collectives (copies, casts), never a
    culprit; `sources`: op index of a collective -> the op whose input is the reduction's own input (DDP:
    the gradient as the communication hook got it, before the hook's compress cast and division); `groups`: op
    index of a collective -> the global ranks of its process group.
    """
    fsdp_ops = fsdp_ops or set()
    first = first_input = None
    collectives = []
    for rec in run.records:
        if is_collective(rec.namespace):
            op = _op(run, rec.index)
            if sources and rec.index in sources:
                src = run.records[sources[rec.index]]
                op["input_absmax"] = _nan_max([run.absmax[s] for s, _ in src.inputs])
                op["reduce_dtypes"] = op["input_dtypes"]  # what the collective itself summed
                op["input_dtypes"] = sorted(str(d).removeprefix("torch.") for d in src.in_dtypes)
            if modules and rec.index in modules:
                op["module"] = modules[rec.index]
            if groups and rec.index in groups:
                op["group"] = list(groups[rec.index])
            collectives.append(op)
            continue
        if is_plumbing(rec.namespace) or rec.name in UNINITIALISED or rec.index in fsdp_ops:
            continue
        if first_input is None and any(p is None and run.kind(s) > 0 for s, p in rec.inputs):
            first_input = _op(run, rec.index)
        # where a NaN/Inf is born: a non-finite output from finite inputs (a view of an empty buffer is not)
        if first is None and any(run.kind(s) > 0 for s in rec.outputs) and all(run.kind(s) == 0 for s, _ in rec.inputs):
            first = _op(run, rec.index)
    return {"precision": run.precision, "loss": run.loss, "forward_finite": run.forward_finite,
            "grads_finite": run.grads_finite, "grad_absmax": run.grad_absmax, "finite": run.finite,
            "ops": len(run.records), "first": first, "first_input": first_input, "collectives": collectives}


@dataclass(frozen=True)
class Decision:
    """The verdict every rank reaches from the gathered summaries.

    Attributes:
        verdict: one of ``DISTRIBUTED_VERDICTS``.
        culprit: the op (``_op``'s fields) plus ``rank``; a collective's adds ``collective``: every
            rank's ``input_absmax`` and ``output_absmax`` and the FP32 run's output abs-max there.
        precision: the run the culprit is from.
    """

    verdict: str
    culprit: dict[str, Any] | None = None
    precision: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


def _born_in_collective(per_rank: list[dict], fp32: list[dict] | None) -> tuple[int, int, dict] | None:
    """The first collective whose inputs are finite on every rank and whose output is not on some rank."""
    count = min(len(s["collectives"]) for s in per_rank)
    for k in range(count):
        calls = [s["collectives"][k] for s in per_rank]
        bad = [r for r, c in enumerate(calls) if not _finite(c["output_absmax"])]
        if bad and all(_finite(c["input_absmax"]) for c in calls):
            rank = bad[0]
            ref = None
            if fp32 is not None and all(k < len(s["collectives"]) for s in fp32):
                ref = _nan_max([s["collectives"][k]["output_absmax"] or 0.0 for s in fp32])
            culprit = dict(calls[rank], rank=rank, collective={
                "ordinal": k, "ranks": [{"rank": r, "input_absmax": c["input_absmax"],
                                         "output_absmax": c["output_absmax"]} for r, c in enumerate(calls)],
                "reduce_dtype": next(iter(calls[rank].get("reduce_dtypes") or calls[rank]["input_dtypes"]), None),
                "group": calls[rank].get("group"),
                "fp32_output_absmax": ref})
            return calls[rank]["index"], rank, culprit
    return None


def _first(per_rank: list[dict], key: str, fp32: list[dict] | None = None) -> dict | None:
    """The earliest op (then the lowest rank) among every rank's `key` op and the collectives' births."""
    found = [(s[key]["index"], r, dict(s[key], rank=r)) for r, s in enumerate(per_rank) if s[key] is not None]
    if key == "first":
        born = _born_in_collective(per_rank, fp32)
        if born is not None:
            found.append(born)
    return min(found, key=lambda t: (t[0], t[1]))[2] if found else None


def decide(runs: dict[str, list[dict]], low: str | None, bad_inputs: list[str]) -> Decision:
    """The verdict from every rank's summary of every run (``runs[precision][rank]``).

    Args:
        low: the low precision under test (None: an FP32 run only).
        bad_inputs: ``param:NAME (rank R's shard)`` / ``batch:KEY (rank R)`` already non-finite before the step.
    """
    fp32 = runs["float32"]
    if bad_inputs:
        p = low if low in runs else "float32"
        culprit = _first(runs[p], "first_input")
        return Decision("nonfinite_input", None if culprit is None else dict(culprit, input=bad_inputs[0]), p)
    if all(s["finite"] for ss in runs.values() for s in ss):
        return Decision("healthy")
    if not all(s["finite"] for s in fp32):
        return Decision("numerical_bug", _first(fp32, "first"), "float32")
    p = low if low in runs and not all(s["finite"] for s in runs[low]) else \
        next(q for q, ss in runs.items() if not all(s["finite"] for s in ss))
    culprit = _first(runs[p], "first", fp32)
    if culprit is None:
        return Decision("not_classified", None, p, (
            f"a rank's loss or gradients are NaN/Inf in {p}, but no op of the model or collective made a NaN/Inf "
            "from finite inputs: the first one is in an op this replay does not blame (FSDP2's own hooks: its "
            "casts and divisions of the gradients) or was read from a value already broken",))
    if "collective" in culprit:
        return Decision("overflow", culprit, p)
    out, inp = culprit["output_absmax"], culprit["input_absmax"]
    if out is not None and math.isinf(out) and _finite(inp):
        return Decision("overflow", culprit, p)
    return Decision("not_classified", culprit, p, (
        f"the op's output is {out} from inputs of abs-max {inp}: whether that is an underflow, a cancellation or "
        f"a bug needs the one-process replay's checks: analyzer replay SNAPSHOT --rank {culprit['rank']}",))

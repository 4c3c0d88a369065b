"""The findings of ``analyzer inspect`` (see the package docstring); the values they return are in ``_result``."""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch

from ..errors import BadInputError
from ..findings import EXIT_FAIL_ON, Finding, sort_findings
from ..load.checkpoint import Checkpoint, Entry
from ..load.checkpoints import load_checkpoint
from ..load._limits import gc_paused
from ..load._stream import LayoutMismatch
from ._optimizer import optimizer_findings
from ._scan import scan_all, scanned_numel
from ._result import (JSON_TENSORS, PRODUCT_HEADROOM, UNDERFLOW_FRAC, FileReport, InspectResult, TensorChange,
                      TensorReport, badness, listed)
from ._stats import FP16_MAX, PairChange, TensorStats

__all__ = ["TensorReport", "FileReport", "TensorChange", "InspectResult", "inspect_checkpoints", "resolve_device",
           "EXIT_FAIL_ON", "JSON_TENSORS", "badness"]

SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq", "square_avg")  # Adam/AdamW, AMSGrad, RMSprop
_PROGRESS_MIN_BYTES = 64 << 20


class _Progress:
    """A throttled one-line byte counter on stderr, for scans of at least 64 MiB."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.last = total, 0, 0.0
        self.enabled = enabled and total >= _PROGRESS_MIN_BYTES

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and now - self.last >= 0.5:
            self.last = now
            sys.stderr.write(f"\rinspect: {self.done / 1e9:.2f} / {self.total / 1e9:.2f} GB "
                             f"({100 * self.done / self.total:.0f}%)")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write(f"\rinspect: {self.total / 1e9:.2f} GB scanned\n")


_EMPTY = (TensorStats(0), None, None)
_EMPTY_PAIR = (TensorStats(0), TensorStats(0), PairChange(0, 0, None))


def _report(e: Entry, stats: TensorStats) -> TensorReport:
    return TensorReport(e.name, e.role, tuple(e.tensor.shape), str(e.tensor.dtype).removeprefix("torch."),
                        stats, e.param, e.slot)


def _nbytes(t: torch.Tensor) -> int:
    return scanned_numel(t) * t.element_size()


def _scan(cka: Checkpoint, ckb: Checkpoint | None, progress: bool, device: str):
    with gc_paused():  # one report per tensor, and a file may list 300,000: no cycles among them to look for
        return _scan_files(cka, ckb, progress, device)


def _scan_files(cka: Checkpoint, ckb: Checkpoint | None, progress: bool, device: str):
    by_b = {e.name: e for e in ckb.entries} if ckb else {}
    total = sum(_nbytes(e.tensor) for e in cka.entries) + sum(_nbytes(e.tensor) for e in by_b.values())
    prog = _Progress(total, progress)
    # each tensor of A with B's tensor of the same name and shape, if any; then B's others
    partner = {e.name: eb for e in cka.entries
               if (eb := by_b.get(e.name)) is not None and eb.tensor.shape == e.tensor.shape}
    alone_b = [eb for eb in by_b.values() if eb.name not in partner]
    items = [(e.tensor, partner[e.name].tensor if e.name in partner else None) for e in cka.entries]
    work = items + [(eb.tensor, None) for eb in alone_b]

    def wait(i: int) -> None:  # the bytes of item i, read by its file's stream (a pair's B: B's)
        a, b = work[i]
        (cka.wait if i < len(items) else ckb.wait)(a)
        if b is not None:
            ckb.wait(b)

    streamed = cka.stream is not None or (ckb is not None and ckb.stream is not None)
    # an empty tensor has nothing to scan: its result is a constant, shared (a file may list 300,000)
    full = [i for i, (a, b) in enumerate(work) if a.numel() or (b is not None and b.numel())]
    scanned = scan_all([work[i] for i in full], device, prog, wait=(lambda j: wait(full[j])) if streamed else None)
    results: list = [_EMPTY_PAIR if b is not None else _EMPTY for _, b in work]
    for i, r in zip(full, scanned):
        results[i] = r
    del scanned
    prog.close()
    rep_a, rep_b, changes = [], {}, []
    for e, (sa, sb, ch) in zip(cka.entries, results):
        rep_a.append(_report(e, sa))
        if sb is not None:
            eb = partner[e.name]
            rep_b[eb.name] = _report(eb, sb)
            if ch is not None:  # NB: tensors expanded differently in A and B are scanned, not compared
                changes.append(TensorChange(e.name, e.role, ch, sa.nonfinite == 0 and sb.nonfinite > 0))
    for eb, (sb, _, _) in zip(alone_b, results[len(cka.entries):]):
        rep_b[eb.name] = _report(eb, sb)
    files = [FileReport(cka, tuple(rep_a))]
    if ckb is not None:
        files.append(FileReport(ckb, tuple(rep_b[e.name] for e in ckb.entries)))
    return files, changes


def _names(reports, top: int = 5) -> str:
    shown = ", ".join(reports[:top])
    return shown + (f", ... ({len(reports) - top} more)" if len(reports) > top else "")


_NONFINITE = {  # role -> (check, what, why and what to do)
    "weight": ("nonfinite_weights", "weight", "the model is poisoned; resume from an earlier checkpoint"),
    "optimizer": ("nonfinite_optimizer_state", "optimizer tensor",
                  "NaN/Inf in optimizer state poisons every later update of that parameter even if the "
                  "weights are restored; resume from an earlier checkpoint or reset the optimizer state"),
    "buffer": ("nonfinite_buffers", "buffer",
               "BatchNorm running stats with NaN/Inf make eval-mode outputs NaN while training looks fine; "
               "a forward pass on a non-finite batch updates them even when GradScaler skips the step"),
    "input": ("nonfinite_inputs", "input tensor", "the batch itself is non-finite; check the data pipeline"),
}


def _nonfinite(fr: FileReport, prefix: str, finite_before: set[str] | None) -> list[Finding]:
    out = []
    for role, (check, what, why) in _NONFINITE.items():
        bad = [t for t in fr.tensors if t.role == role and t.stats.nonfinite]
        if not bad:
            continue
        bad.sort(key=lambda t: -t.stats.nonfinite / max(t.stats.numel, 1))
        label = [f"{t.name} ({t.stats.nonfinite} of {t.stats.numel} values)" for t in bad]
        noun = f"{what}s hold" if len(bad) > 1 else f"{what} holds"
        msg = f"{prefix}{len(bad)} {noun} NaN/Inf: {_names(label)}; {why}"
        ev = listed({"file": fr.ckpt.path}, "tensors", [
            {"name": t.name, "nan": t.stats.nan, "inf": t.stats.inf, "numel": t.stats.numel,
             **({} if finite_before is None else {"finite_in_a": t.name in finite_before})}
            for t in bad[:JSON_TENSORS]], len(bad))
        out.append(Finding(check, "error", fr.ckpt.step, msg, ev))
    return out


def _implausible(fr: FileReport) -> list[Finding]:
    """Values no training run saves (``Checkpoint.implausible``): named, never dropped in silence."""
    bad = fr.ckpt.implausible
    if not bad:
        return []
    msg = (f"{fr.label}: {len(bad)} value{'s' if len(bad) > 1 else ''} no training run saves: " + "; ".join(bad[:8])
           + (f"; and {len(bad) - 8} more" if len(bad) > 8 else "") + " (was the file edited or written by other code?)")
    return [Finding("implausible_checkpoint", "warning", fr.ckpt.step, msg,
                    {"file": fr.ckpt.path, "values": bad[:JSON_TENSORS], "count": len(bad)})]


def _range_risk(fr: FileReport, prefix: str) -> list[Finding]:
    """FP16 range risk from values alone. NB: the weight's abs-max is the first-order signal; the
    product estimate abs_max * sqrt(fan_in) is the output scale of a row whose every weight were as
    large as the largest, for unit-rms inputs, flagged when within PRODUCT_HEADROOM of 65504.
    It can miss (inputs far above unit scale) and over-warn (a single outlier weight)."""
    risks = []
    for t in fr.tensors:
        s = t.stats
        if t.role not in ("weight", "input") or s.abs_max is None:
            continue
        if s.fp16_overflow:
            n = s.fp16_overflow
            risks.append((t, "value_overflow", s.abs_max,
                          f"abs-max {s.abs_max:.3g}: {n} value{'s become' if n > 1 else ' becomes'} inf"))
        elif t.role == "weight" and len(t.shape) >= 2 and s.numel:
            fan_in = s.numel // t.shape[0]
            est = s.abs_max * math.sqrt(fan_in)
            if est > FP16_MAX / PRODUCT_HEADROOM:
                risks.append((t, "product_overflow", est, f"abs-max*sqrt(fan_in {fan_in}) = {est:.3g}"))
        if t.role == "weight" and s.frac(s.fp16_flush) >= UNDERFLOW_FRAC:
            risks.append((t, "underflow", s.frac(s.fp16_flush), f"{s.frac(s.fp16_flush):.1%} of values flush to zero"))
    if not risks:
        return []
    order = {"value_overflow": 0, "product_overflow": 1, "underflow": 2}
    risks.sort(key=lambda r: (order[r[1]], -r[2]))
    msg = (f"{prefix}{len(risks)} tensor{'s' if len(risks) > 1 else ''} at FP16 range risk (the weight's abs-max "
           f"is the first-order signal; products use abs-max*sqrt(fan_in) > {FP16_MAX / PRODUCT_HEADROOM:.0f}, "
           f"a heuristic): {_names([f'{t.name} ({why})' for t, _, _, why in risks])}")
    ev = listed({"file": fr.ckpt.path}, "tensors", [
        {"name": t.name, "reason": kind, "value": v, "abs_max": t.stats.abs_max, "shape": list(t.shape)}
        for t, kind, v, _ in risks[:JSON_TENSORS]], len(risks))
    return [Finding("fp16_range_risk", "warning", fr.ckpt.step, msg, ev)]


def _dead_state(fr: FileReport, prefix: str) -> list[Finding]:
    zero = [t for t in fr.tensors if t.role == "optimizer" and t.slot in SECOND_MOMENTS
            and t.stats.numel and t.stats.nonfinite == 0 and t.stats.zeros == t.stats.numel]
    stateless = [p for o in fr.ckpt.optimizers for p in o.stateless]
    parts = []
    if zero:
        parts.append(f"{len(zero)} second-moment tensor{'s are' if len(zero) > 1 else ' is'} all zero "
                     f"(the parameter never got a non-zero gradient): {_names([t.name for t in zero])}")
    if stateless:
        parts.append(f"{len(stateless)} parameter{'s have' if len(stateless) > 1 else ' has'} no optimizer state "
                     f"while others do (never stepped): {_names(stateless)}")
    if not parts:
        return []
    ev = listed(listed({"file": fr.ckpt.path}, "zero_second_moment", [t.name for t in zero[:JSON_TENSORS]], len(zero)),
                 "no_state", stateless[:JSON_TENSORS], len(stateless))
    hint = "frozen on purpose? then ignore, else check requires_grad and the optimizer's param groups"
    return [Finding("dead_optimizer_state", "warning", fr.ckpt.step, f"{prefix}{'; '.join(parts)}; {hint}", ev)]


def _stalled(changes: list[TensorChange], step: int | None) -> list[Finding]:
    if not changes:
        return []
    stalled = [c.name for c in changes if c.change.stalled and c.role == "weight"]
    if all(c.change.stalled for c in changes):
        msg = (f"nothing changed between A and B: all {len(changes)} shared tensors are bit-identical "
               "(the same checkpoint twice, or training never stepped)")
    elif stalled:
        msg = (f"{len(stalled)} weight{'s' if len(stalled) > 1 else ''} never moved between A and B while others did: "
               f"{_names(stalled)}; frozen on purpose? then ignore, else check requires_grad, the optimizer's "
               "param groups, and whether GradScaler skipped every step")
    else:
        return []
    ev = listed({}, "stalled", stalled[:JSON_TENSORS], len(stalled))
    return [Finding("dead_optimizer_state", "warning", step, msg, {**ev, "compared": len(changes)})]


def resolve_device(device: str) -> str:
    """``"auto"``: cuda when torch sees a GPU, else cpu. ``"cuda"`` without one is a BadInputError."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise BadInputError("--device cuda: torch sees no CUDA device here",
                            fix="use --device cpu (or auto), or install a CUDA build of torch")
    return device


def inspect_checkpoints(path_a: str | os.PathLike, path_b: str | os.PathLike | None = None, *,
                        progress: bool = False, device: str = "cpu") -> InspectResult:
    """Scan one checkpoint (or A then B) and diagnose it. Raises AnalyzerError subclasses on bad input.

    `device` is where the scan runs (``"cpu"``, ``"cuda"`` or ``"auto"``); the results are the same.

    Example:
        >>> result = inspect_checkpoints("good.pt", "bad.pt")  # doctest: +SKIP
        >>> [f.check for f in result.findings]  # doctest: +SKIP
        ['nonfinite_optimizer_state', 'dead_optimizer_state']
    """
    device = resolve_device(device)
    try:
        return _inspect(path_a, path_b, progress, device, stream=True)
    except LayoutMismatch:  # a file torch.save did not lay out: read again, each record from its header
        return _inspect(path_a, path_b, progress, device, stream=False)


def _inspect(path_a, path_b, progress: bool, device: str, stream: bool) -> InspectResult:
    # NB: each file's CRC-32 check runs in a second thread during the scan, and is waited for before
    # any finding is made: a damaged file is refused exactly as before, about the scan's time sooner.
    # A large file not in the page cache is read once, front to back, and the scan follows the read
    # (each tensor after its bytes are in); a pair's two files are read in turns, a block each.
    cka = load_checkpoint(path_a, defer_crc=True, stream=stream)
    try:
        ckb = (load_checkpoint(path_b, defer_crc=True, stream=stream, beside=cka.stream)
               if path_b is not None else None)
    except BaseException:
        cka.verify()
        raise
    checks = [ck.verify for ck in (cka, ckb) if ck is not None]
    try:
        files, changes = _scan(cka, ckb, progress, device)
    finally:  # also when the scan failed: a damaged record is the cause to name
        for verify in checks:
            verify()
    later = ckb or cka  # NB: optimizer checks look at the later file, after its read, before the tensors go
    findings = optimizer_findings(later, f"{Path(later.path).name}: " if ckb is not None else "")
    for ck in (cka, ckb):  # the result keeps statistics, not tensors: let the file mappings go
        if ck is not None:
            ck.entries.clear()
    pair = len(files) == 2
    finite_a = {t.name for t in files[0].tensors if not t.stats.nonfinite} if pair else None
    for i, fr in enumerate(files):
        prefix = f"{fr.label}: " if pair else ""
        findings += _implausible(fr)
        findings += _nonfinite(fr, prefix, finite_a if i == 1 else None)
        if i == len(files) - 1:  # NB: for a pair, range and dead-state checks look at B, the later one
            findings += _range_risk(fr, prefix)
            findings += _dead_state(fr, prefix)
    if pair:
        findings += _stalled(changes, files[1].ckpt.step)
    names_b = {t.name for t in files[1].tensors} if pair else set()
    names_a = {t.name for t in files[0].tensors}
    return InspectResult(
        files=tuple(files), findings=tuple(sort_findings(findings)),
        changes=tuple(changes) if pair else None,
        only_in_a=tuple(sorted(names_a - names_b)) if pair else (),
        only_in_b=tuple(sorted(names_b - names_a)) if pair else (),
    )


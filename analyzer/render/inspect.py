"""Plain-text rendering of an ``analyzer inspect`` result: findings, then tensors, worst first."""
from __future__ import annotations

from typing import Any

__all__ = ["render_inspect_text", "badness"]


def badness(t) -> tuple:
    """Sort key, worst first: ``analyzer.inspect.badness`` (imported on first use: it imports torch)."""
    from ..inspect import badness as key
    return key(t)


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _frac(count: int, numel: int) -> str:
    if not count:
        return "0"
    f = count / numel
    return f"{f:.1%}" if f >= 0.001 else f"{count}/{numel}"


def _header(fr) -> list[str]:
    c = fr.ckpt
    kind = c.layout.replace("_", " ")
    step = f", step {c.step} (key {c.step_key!r})" if c.step is not None else ""
    fmt = "" if c.format == c.layout else f", {c.format.replace('-', ' ')}"
    lines = [f"inspect {c.path}: {kind}{fmt}, {_size(c.nbytes)}{step}"]
    parts = []
    if c.model_paths and c.layout not in ("state_dict", "safetensors", "hf_checkpoint"):
        parts.append("model " + ", ".join(repr(p) for p in c.model_paths))
    for o in c.optimizers:
        how = {"param_names": "names exact (param_names)", "order": "names by order (a guess)",
               "none": "ids not mapped to names",
               "hf_trainer": "names exact (HF Trainer's parameter groups)"}.get(o.mapping, o.mapping)
        parts.append(f"optimizer {o.path!r}: {o.n_params} params, {how}")
    if c.scaler:
        parts.append(f"scaler scale {c.scaler['scale']:g}")
    if parts:
        lines.append("  " + "; ".join(parts))
    for o in c.optimizers:
        if o.mapping not in ("param_names", "hf_trainer"):
            lines.append(f"  NB optimizer {o.path!r}: {o.note}")
    lines += [f"  note: {n}" for n in getattr(c, "notes", ())]
    n = c.non_floating
    skipped = f", {n} integer/bool/sparse tensor{'s' if n > 1 else ''} skipped" if n else ""
    lines.append(f"  {len(fr.tensors)} floating-point tensors scanned{skipped}")
    return lines


def _table(fr, top: int) -> list[str]:
    from ..inspect import badness as key

    rows = sorted(fr.tensors, key=key)[:top]
    if not rows:
        return []
    width = min(max(len(t.name) for t in rows), 60)
    dw = max(8, *(len(t.dtype) for t in rows))
    head = (f"  {'role':9} {'name':{width}} {'dtype':{dw}} {'shape':14} {'nan/inf':>9} {'abs-max':>9} "
            f"{'min|x|>0':>9} {'fp16 inf':>8} {'fp16 ->0':>8} {'bf16 ->0':>8}")
    out = [f"tensors of {fr.label}, worst first (top {len(rows)} of {len(fr.tensors)}):", head]
    for t in rows:
        s = t.stats
        name = t.name if len(t.name) <= width else "..." + t.name[-(width - 3):]
        shape = "x".join(map(str, t.shape)) or "scalar"
        out.append(f"  {t.role:9} {name:{width}} {t.dtype:{dw}} {shape:14} {f'{s.nan}/{s.inf}':>9} "
                   f"{_g(s.abs_max):>9} {_g(s.min_nonzero):>9} {_frac(s.fp16_overflow, s.numel):>8} "
                   f"{_frac(s.fp16_flush, s.numel):>8} {_frac(s.bf16_flush, s.numel):>8}")
    return out


def _changes(result: Any, top: int) -> list[str]:
    changes = result.changes
    a, b = result.files[0].label, result.files[1].label
    out = [f"changes {a} -> {b} ({len(changes)} tensors compared):"]
    nonfinite = [c.name for c in changes if c.became_nonfinite]
    stalled = [c.name for c in changes if c.change.stalled]
    if nonfinite:
        out.append(f"  became non-finite ({len(nonfinite)}): " + ", ".join(nonfinite[:top])
                   + (" ..." if len(nonfinite) > top else ""))
    if stalled:
        out.append(f"  stalled, bit-identical ({len(stalled)}): " + ", ".join(stalled[:top])
                   + (" ..." if len(stalled) > top else ""))
    moved = sorted((c for c in changes if c.change.rel_change and not c.name.endswith("].step")),
                   key=lambda c: -c.change.rel_change)[:top]
    if moved:
        width = min(max(len(c.name) for c in moved), 60)
        out.append(f"  largest relative change |B-A|/|A| (top {len(moved)}):")
        for c in moved:
            out.append(f"    {c.name:{width}} {c.change.rel_change:10.3g}  "
                       f"({_frac(c.change.changed, c.change.numel)} of values changed)")
    if result.only_in_a or result.only_in_b:
        out.append(f"  only in {a}: {len(result.only_in_a)} tensors; only in {b}: {len(result.only_in_b)} tensors")
    return out


def render_inspect_text(result: Any, top: int = 10) -> str:
    """Findings (most severe first), then each file's tensors worst first, then the A -> B changes."""
    lines = []
    for fr in result.files:
        lines += _header(fr)
    lines.append("")
    if result.findings:
        lines.append("findings, worst first:")
        for f in result.findings:
            lines.append(f"  {f.severity:8} {f.check:26} {f.message}")
    else:
        lines.append("findings: none (no NaN/Inf, no FP16 range risk, no dead optimizer state)")
    for fr in result.files:
        lines += [""] + _table(fr, top)
    if result.changes is not None:
        lines += [""] + _changes(result, top)
    return "\n".join(lines)

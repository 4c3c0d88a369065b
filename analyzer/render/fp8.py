"""Plain-text rendering of ``analyzer fp8-readiness``: the operands that break, the table, the filter."""
from __future__ import annotations

__all__ = ["render_readiness_text"]


def _pct(frac: float) -> str:
    return "0" if frac == 0 else f"{frac:.1%}" if frac >= 0.001 else f"{frac:.2g}"


def _cell(use: str, s, breaks: bool) -> str:
    parts = [f"{_pct(s.flushed_frac)} flushed"]
    if s.saturated:
        parts.append(f"{_pct(s.saturated_frac)} saturated")
    return ("BREAKS " if breaks else "") + ", ".join(parts) + (f" ({use})" if breaks else "")


def render_readiness_text(r, *, source: str = "") -> str:
    """The breaking operands per recipe first, with the ``module_filter_fn`` for each, then every operand."""
    from analyzer.replay.fp8.readiness import FLUSH_LIMIT, RECIPES, SATURATE_LIMIT

    lines = [f"fp8 readiness{' of ' + source if source else ''}: the step replayed in {r.precision}, "
             f"{len({o.module for o in r.operands})} Linear layers, loss {r.loss:.6g}",
             f"a cast breaks when over {FLUSH_LIMIT:.0%} of its non-zero values flush to zero or over "
             f"{SATURATE_LIMIT:.2%} of its values pass the format's max"]
    if not r.operands:
        lines.append("no nn.Linear ran in the step: nothing FP8 training would convert")
        return "\n".join(lines)
    for recipe in RECIPES:
        broken = r.breaking(recipe)
        if not broken:
            lines.append(f"{recipe}: no cast breaks")
            continue
        lines.append(f"{recipe}: {len(broken)} cast{'s' if len(broken) > 1 else ''} break:")
        for o in broken:
            use, s = o.casts[recipe]
            lines.append(f"  {o.module} {o.role} ({use}, {s.fmt}): {_cell(use, s, False)}; amax {o.amax:.3g}, "
                         f"amax/median {o.dynamic_range:.3g}")
        lines.append(f"  keep them in {r.precision} under {recipe}:")
        lines.extend("    " + line for line in r.module_filter_fn(recipe).splitlines())
    lines.append("")
    lines.append("every operand (worst cast of its two uses):")
    width = max(len(o.module) for o in r.operands)
    for o in r.operands:
        cells = "  ".join(f"{k}: {_cell(*o.casts[k], o.breaks(k))}" for k in RECIPES)
        lines.append(f"  {o.module:<{width}}  {o.role:<11}  amax {o.amax:<9.3g} amax/median {o.dynamic_range:<9.3g} "
                     f"{cells}")
    return "\n".join(lines)

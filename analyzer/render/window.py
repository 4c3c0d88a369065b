"""The text of ``replay --steps K``: the window's steps in FP32 and the run's precision, where they part, the spike.

Real output (``tests/analyzer/replay/test_window.py``'s BF16 run whose batch at step 30 carries an offset
its BF16 features cannot centre)::

    rewind window: steps 25..30 replayed from one state in FP32 and bfloat16 (the window holds 24..30, Recorder(rewind=6))
      step  recorded    fp32        bfloat16    difference
      25    0.01215     0.01211     0.01215     0.29%
      26    0.007298    0.007347    0.007298    0.66%
      27    0.00823     0.008044    0.00823     2.3%
      28    0.009009    0.008885    0.009009    1.4%
      29    0.01228     0.01241     0.01228     1.1%
      30    0.3422      0.01281     0.3422      2571%  <- part
    tolerance 17.3%: max(8 x bfloat16's unit roundoff 0.39%, half the recorded loss's median step-to-step change 34.5%)
    FP32 and bfloat16 part at step 30 (losses 0.01281 and 0.3422).
    FP32 from the same state does not spike at step 30 (loss 0.01281 <= the trigger's threshold 0.1303); bfloat16 does (0.3422): the spike comes from low precision in these steps.
    The bfloat16 replay matches the recorded losses exactly.
    note: step 24 was replayed in bfloat16 first, as training did, to reach the state before step 25

How to read it: both trajectories start from the same weights and optimizer state and see the same
batches, RNG, loss scales and learning rates; only their arithmetic differs. ``<- part`` marks the first
step whose losses differ beyond the tolerance (``analyzer/replay/window/result.py`` says why that one).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # NB: analyzer.replay imports torch; rendering must not
    from ..replay.window import WindowResult

__all__ = ["render_window_text"]


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{v:.4g}"


def _pct(v) -> str:
    if v is None:
        return "-"
    if not math.isfinite(v):
        return "inf"
    return f"{100 * v:.2g}%" if v < 0.1 else f"{100 * v:.0f}%" if v >= 1 else f"{100 * v:.1f}%"


def _spike_line(w: WindowResult, low: str) -> str | None:
    sp = w.spike
    if sp is None:
        return None
    m, thr, f, lo = sp["metric"], _num(sp["threshold"]), _num(sp["fp32"]), _num(sp["low"])
    if sp["fp32_spikes"]:
        return (f"FP32 from the same state spikes too at step {w.step} ({m} {f} > the trigger's threshold {thr}): "
                "low precision in these steps did not cause the spike.")
    if sp["low_spikes"]:
        return (f"FP32 from the same state does not spike at step {w.step} ({m} {f} <= the trigger's threshold "
                f"{thr}); {low} does ({lo}): the spike comes from low precision in these steps.")
    return (f"Neither replay spikes at step {w.step} ({m}: FP32 {f}, {low} {lo}, threshold {thr}; recorded "
            f"{_num(sp['recorded'])}): the recorded spike was not reproduced.")


def _finite_line(w: WindowResult, low: str) -> str | None:
    if w.spike is not None or not w.precision:
        return None
    bad = {p: next((r["step"] for r in w.rows if not _finite(r.get(k))), None)
           for p, k in (("FP32", "fp32_loss"), (low, "low_loss"))}
    if bad["FP32"] is None and bad[low] is None:
        return f"Both losses stay finite through step {w.step}."
    said = [f"{p} is NaN/Inf from step {s}" if s is not None else f"{p} stays finite through step {w.step}"
            for p, s in bad.items()]
    return "; ".join(said) + "."


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def render_window_text(w: WindowResult) -> str:
    """The window replay as text (see the module docstring)."""
    low = w.precision or "float32"
    rows = [s["step"] for s in w.rows]
    lines = [f"rewind window: steps {rows[0]}..{rows[-1]} replayed from one state in FP32"
             + (f" and {low}" if w.precision else "")
             + f" (the window holds {w.start_step}..{w.step}, Recorder(rewind={w.steps_recorded}))"]
    head = f"  {'step':<6}{'recorded':<12}{'fp32':<12}" + (f"{low:<12}difference" if w.precision else "")
    lines.append(head.rstrip())
    for r in w.rows:
        line = f"  {r['step']:<6}{_num(r['recorded_loss']):<12}{_num(r['fp32_loss']):<12}"
        if w.precision:
            line += f"{_num(r['low_loss']):<12}{_pct(r['difference'])}"
            line += "  <- part" if r["step"] == w.part_step else ""
        if r["recorded_skipped"]:
            line += "  (skipped: GradScaler found inf)"
        lines.append(line.rstrip())
    if w.precision:
        lines.append(f"tolerance {_pct(w.tolerance)}: max(8 x {low}'s unit roundoff {_pct(w.unit_roundoff)}, half the "
                     f"recorded loss's median step-to-step change {_pct(w.loss_noise)})")
        if w.part_step is not None:
            r = next(r for r in w.rows if r["step"] == w.part_step)
            lines.append(f"FP32 and {low} part at step {w.part_step} (losses {_num(r['fp32_loss'])} and "
                         f"{_num(r['low_loss'])}).")
        else:
            lines.append(f"FP32 and {low} stay within {_pct(w.tolerance)} of each other over the {len(w.rows)} steps.")
    else:
        lines.append("The run trained in FP32: one trajectory, nothing to compare it with.")
    for line in (_spike_line(w, low), _finite_line(w, low)):
        if line:
            lines.append(line)
    if w.reproduction is not None:
        lines.append(f"The {low} replay matches the recorded losses exactly." if w.reproduction == 0 else
                     f"The {low} replay's losses are within {_pct(w.reproduction)} of the recorded ones.")
    if w.unrecorded_skips:
        lines.append(f"The {low} replay skipped step(s) {', '.join(map(str, w.unrecorded_skips))} (non-finite scaled "
                     "gradients) where training stepped.")
    lines += [f"note: {n}" for n in w.notes]
    return "\n".join(lines)

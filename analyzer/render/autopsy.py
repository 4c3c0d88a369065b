"""Render an ``AutopsyResult`` as text: the answer first, in a few lines; the evidence after.

The evidence is the report and each replay exactly as ``analyzer report`` and ``analyzer replay``
print them, except the replay's own "what to try" list: its suggestions are untried, and the
answer above already lists each of them with the status its counterfactual replay gave (a fix
that fails must never read as a recommendation).

Real output (the demo run; long lines and the evidence cut here)::

    amp-autopsy autopsy: amp-autopsy-demo/fp16_attention_overflow
    verdict: overflow
    answer:
      root cause: overflow: aten.bmm in `blocks.0.attn` (forward, float16) at samples/models.py:98 ...
      where: aten.bmm in blocks.0.attn at samples/models.py:98, forward, float16, step 24, rank 0 ...
      verified fix: switch from FP16 to BF16: step 24 runs finite in bfloat16: loss and every gradient; ...
      tried, fails: run aten.bmm in blocks.0.attn (forward) alone in FP32, its result cast back to float16: ...
      (replays run the failing step's forward and backward only, not the optimizer step)

    ------------------------------------------------------------------------
    evidence 1/2: analyzer report amp-autopsy-demo/fp16_attention_overflow
    ------------------------------------------------------------------------
    amp-autopsy report: amp-autopsy-demo/fp16_attention_overflow (amp-autopsy run, float16 AMP, ...
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .replay import render_replay_text
from .report import render_report_text
from .window import render_window_text

if TYPE_CHECKING:
    from ..autopsy import AutopsyResult

__all__ = ["render_autopsy_text"]

_RULE = "-" * 72


def render_autopsy_text(autopsy: AutopsyResult, *, ops: int = 8) -> str:
    """The answer, then ``evidence N/M`` sections: the report, then each replay (``ops`` around its culprit)."""
    lines = [f"amp-autopsy autopsy: {autopsy.run}", f"verdict: {autopsy.verdict}", "answer:"]
    lines += [f"  {line}" for line in autopsy.answer()]
    if any(r.culprit is None or r.culprit["phase"] != "optimizer" for r in autopsy.replays):
        lines.append("  (replays run the failing step's forward and backward only, not the optimizer step)")
    # A replay that blames the same op as an earlier one is the answer's one "also" line; in full in --json.
    shared = dict(autopsy.shared)
    shown = [r for r in autopsy.replays if r.snapshot not in shared]
    total = 1 + len(shown)
    if autopsy.report is not None:
        lines += ["", _RULE, f"evidence 1/{total}: analyzer report {autopsy.report.run}", _RULE,
                  render_report_text(autopsy.report)]
    else:
        lines += ["", _RULE, f"evidence 1/{total}: no report", _RULE,
                  f"{autopsy.run} holds no training log (an HF checkpoint's trainer_state.json): there is no loss, "
                  "scale or gradient-norm history to report on; the answer rests on the replay of its batch alone"]
    for i, result in enumerate(shown, start=2):
        bare = dataclasses.replace(result, advice_lines=())  # its untried advice is in the answer, with a status
        lines += ["", _RULE, f"evidence {i}/{total}: analyzer replay {result.snapshot}", _RULE,
                  render_replay_text(bare, ops=ops)]
    for w in autopsy.windows:
        lines += ["", render_window_text(w)]
    if shared:
        lines += ["", f"({len(shared)} more replay(s) blame the same op as one above: the answer's \"also\" "
                      "lines; --json holds them in full)"]
    return "\n".join(lines)

"""Human rendering of a ``ReplayResult``: a short diagnosis, an op table, and a matplotlib plot."""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from ..load.exceptions import raised_text

if TYPE_CHECKING:  # NB: analyzer.replay imports torch; rendering a report must not
    from ..replay.result.replay_result import ReplayResult

__all__ = ["render_replay_text", "plot_replay", "replay_figure"]

def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v:.3g}"
    return str(v)


def _micro_text(micro: dict) -> str:
    """How the replay combined an accumulating step's micro-batches (``schema.MICRO_BATCH_COMBINES``)."""
    from recorders import schema

    how = schema.MICRO_BATCH_COMBINES.get(micro["combine"], micro["combine"])
    if micro["combine"] == "num_items_in_batch":
        n = micro.get("num_items_in_batch")
        how += f" (num_items_in_batch={n})" if n is not None else " (num_items_in_batch)"
    elif micro["combine"] == "mean" and micro["divisor"] != micro["count"]:  # a step cut short by an exception
        how += f" ({micro['divisor']:g}, the whole step's; {micro['count']} ran)"
    elif micro["combine"] != "sum":
        how += f" ({micro['divisor']:g})"
    if micro.get("source") == "batch_file":  # no recorder: the normalisation is the --accumulate one (NB line)
        return f"accumulated {micro['count']} micro-batches of the batch file as --accumulate says (NB below): {how}"
    return f"accumulated {micro['count']} micro-batches as training did: {how}"


def render_replay_text(result: ReplayResult, ops: int = 8) -> str:
    """A short diagnosis: verdict, what/where/why, runs per precision, op table, advice."""
    r = result
    lines = [f"NB: {note}" for note in r.load_notes]  # what loading found implausible, before any verdict
    lines += [f"verdict: {r.verdict}", f"  {r.summary}"]
    head = f"snapshot: {r.snapshot} (step {r.step}, {r.reason})" if r.step is not None else f"snapshot: {r.snapshot}"
    lines.append(head)
    if r.exception:  # an exception snapshot: what the step raised before end_step
        lines.append(f"raised: {raised_text(r.exception)}")
    lines.append(f"replayed on {r.device} (recorded on {r.recorded_device}), amp dtype {r.amp_dtype or 'none'}, "
                 f"loss scale {r.scale:g}")
    if r.precision_mode != "autocast" and r.precision_note:  # autocast: the amp dtype above says it
        lines.append(f"  {r.precision_note}")
    if r.device_note:
        lines.append(f"  NB: {r.device_note}")
    if r.micro_batches:  # a step that accumulated gradients: how its micro-batches were re-run
        lines.append(f"  {_micro_text(r.micro_batches)}")
    for note in (r.checkpoint or {}).get("notes", ()):  # a checkpoint and a batch: what stood in for the snapshot
        lines.append(f"  NB: {note}")
    from ..replay.result.records import headline  # loaded with the replay that made `result`

    c = headline(r.culprit)  # the op the answer leads with, as --json's culprit
    if c:
        lines += ["", "culprit:",
                  f"  op        {c['op']}" + (f".{c['overload']}" if c["phase"] != "optimizer" else "")
                  + (" (custom op)" if c.get("custom") else ""),
                  f"  module    {c['module']}",
                  f"  phase     {c['phase']}" + (f" ({c['node']})" if c.get("node") else ""),
                  f"  precision {c['precision']}   op #{c['index']}",
                  f"  source    {c.get('source') or '-'}",
                  f"  inputs    {', '.join(c['input_dtypes']) or '-'}  abs-max {_num(c['input_absmax'])}",
                  f"  output    {c.get('output_dtype') or '-'}  abs-max {_num(c['output_absmax'])}"]
        if c.get("input"):
            lines.append(f"  bad input {c['input']}")
        if c.get("micro_batch") is not None and r.micro_batches:
            lines.append(f"  micro-batch {c['micro_batch']} of {r.micro_batches['count']} (0-based)")
        sh = c.get("shadow")
        if sh:
            lines.append(f"  shadow    FP32 abs-max {_num(sh['float32'])}, FP64 {_num(sh['float64'])} "
                         f"({c['precision']} max {_num(sh['dtype_max'])})")
        if c.get("fp32_output_absmax") is not None:
            lines.append(f"  FP32 run  same op abs-max {_num(c['fp32_output_absmax'])}")
        jump = c.get("magnitude_jump")
        if jump:  # overflow: the op feeding the culprit where the magnitude jumped the most
            f = jump.get("factor")
            by = ""
            if f:
                of = f" of `{f['reads']}` = {_num(f['reads_absmax'])}" if f.get("reads") else ""
                by = f", times {f['op']}{of} op #{f['index']}"
            lines.append(f"  grew at   {jump['op']} in `{jump['module']}` op #{jump['index']} ({jump['phase']}) at "
                         f"{jump.get('source') or '-'} abs-max {_num(jump['input_absmax'])} -> "
                         f"{_num(jump['output_absmax'])} (x{_num(jump['growth'])}{by})")
        s = c.get("surfaced_at")
        if s:  # the culprit is a forward NaN/Inf a later op hid: where it made the step fail
            lines.append(f"  surfaced  {s['op']} in `{s['module']}` op #{s['index']} ({s['phase']}"
                         + (f", {s['node']}" if s.get("node") else "") + f") at {s.get('source') or '-'}: "
                         f"output {_num(s['output_absmax'])} from inputs up to {_num(s['input_absmax'])}")
        for key, label in (("underflow_at", "zeros from"), ("literal_nonfinite", "mask value"),
                           ("hidden", "hidden")):
            o = c.get(key) if not (key == "hidden" and s) else None  # the hidden op is the culprit itself
            if o:
                extra = f" zeros {o['zeros']} vs {o['fp32_zeros']} in FP32" if key == "underflow_at" else ""
                lines.append(f"  {label:<9} {o['op']} in `{o['module']}` op #{o['index']} "
                             f"({o['phase']}) at {o.get('source') or '-'}{extra}")
    if r.nonfinite_inputs:
        lines.append("  non-finite before the step: " + ", ".join(r.nonfinite_inputs[:8])
                     + (" ..." if len(r.nonfinite_inputs) > 8 else ""))
    if r.mask_inputs:
        lines.append("  -inf masks among the inputs (written on purpose): " + ", ".join(r.mask_inputs[:8])
                     + (" ..." if len(r.mask_inputs) > 8 else ""))
    if r.written_only_buffers:
        lines.append("  non-finite but only written by the step (not a cause): "
                     + ", ".join(r.written_only_buffers[:8]) + (" ..." if len(r.written_only_buffers) > 8 else ""))
    if r.update is not None:  # update forensics: no forward/backward runs to list
        lines += _update_lines(r.update)
    lines += ["", "runs:"] if r.runs else []
    for p, run in r.runs.items():
        state = "finite" if run["finite"] else ("forward NaN/Inf" if not run["forward_finite"] else "backward NaN/Inf")
        at1 = ""
        if "finite_at_scale_1" in run:
            at1 = f"; at scale 1: {'finite' if run['finite_at_scale_1'] else 'still NaN/Inf'}"
        first = run.get("first_nonfinite")
        where = f"; first at #{first['index']} {first['op']} in `{first['module']}` ({first['phase']})" if first else ""
        own = f" (at loss scale {run['scale']:g})" if run["scale"] != r.scale else ""  # BF16 run for its advice
        lines.append(f"  {p:<9} loss {_num(run['loss']):>10}  {state}{own}{at1}{where}")
    fp8 = (r.evidence or {}).get("fp8")
    if fp8 is not None:  # the step trained in FP8: its FP8 run, the casts that broke, the comparison with BF16
        lines += _fp8_lines(fp8.to_dict()["fp8"])
    if r.compiled is not None:  # a compiled model: the step compiled as training compiled it
        lines += _compiled_lines(r.compiled)
    trace = r.culprit_trace
    if c and trace is not None and ops > 0:
        lines += ["", f"ops around the culprit ({trace.precision}):", _table(trace, c["index"], ops)]
    checked = {a.text for a in r.advice_lines if a.checked}  # what the values show, not something to try
    if [a for a in r.advice if a not in checked]:
        lines += ["", "what to try:"] + [f"  - {a}" for a in r.advice if a not in checked]
    if checked:
        lines += ["", "checked:"] + [f"  - {a}" for a in r.advice if a in checked]
    return "\n".join(lines)


def _compiled_lines(cmp: dict) -> list[str]:
    """The compiled run of the failing precision (or why it could not be reproduced), its run with eager's
    dropout masks when the step draws random numbers, and its first non-finite Inductor kernel."""
    lines = [_compiled_line(cmp)]
    same = (cmp.get("random") or {}).get("same_masks")
    if same is not None:
        state = ("finite" if same["finite"] else
                 "forward NaN/Inf" if not same["forward_finite"] else "backward NaN/Inf")
        lines.append(f"  compiled  {cmp['precision']} loss {_num(same['loss']):>10}  {state} (eager's dropout masks: "
                     "fallback_random; the line above drew training's)")
    k = cmp.get("kernel")
    if k:
        ops = ", ".join(k["ops"][:8]) + (" ..." if len(k["ops"]) > 8 else "")
        src = ", ".join(k["sources"][:4]) + (" ..." if len(k["sources"]) > 4 else "")
        lines.append(f"  kernel    {k['kernel']} ({k['graph']} graph): first NaN/Inf output; {ops}"
                     + (f" at {src}" if src else ""))
    return lines


def _compiled_line(cmp: dict) -> str:
    """One line: the compiled run of the failing precision, or why it could not be reproduced."""
    if not cmp.get("reproduced"):
        return f"  compiled  {cmp['note']}"
    state = "finite" if cmp["finite"] else ("forward NaN/Inf" if not cmp["forward_finite"] else "backward NaN/Inf")
    where = ", ".join(f"`{m['path']}`" if m["path"] else "the whole model" for m in cmp["modules"][:3])
    more = f" and {len(cmp['modules']) - 3} more" if len(cmp["modules"]) > 3 else ""
    smallest = f"; smallest non-finite compiled module `{cmp['module']}`" if cmp.get("module") else ""
    micro = ""
    if cmp.get("micro_batches"):  # an accumulating step: every micro-batch ran compiled
        bad = cmp.get("micro_batch")
        micro = f"; {cmp['micro_batches']} micro-batches" + ("" if bad is None else f", non-finite from micro-batch {bad}")
    return (f"  compiled  {cmp['precision']} loss {_num(cmp['loss']):>10}  {state} ({cmp['backend']}: {where}{more})"
            f"{smallest}{micro}")


def _update_lines(u: dict, shown: int = 3) -> list[str]:
    """The update forensics (``analyzer.replay.update.forensics``): per parameter, the factor behind each NaN/Inf."""
    lines = ["", f"update forensics ({u['optimizer']}; forward and backward not replayed):"]
    for p in u["params"][:8]:
        why = ", ".join(f"{k} {n}" for k, n in p["factors"].items())
        lines.append(f"  {p['name']} ({p['dtype']}, state {p['state_dtype']}): {p['nonfinite']} of {p['numel']} "
                     f"NaN/Inf; {why}")
        if p["formula"]:
            hyper = ", ".join(f"{k}={_num(v) if not isinstance(v, list) else v}" for k, v in p["hyperparameters"].items())
            lines.append(f"    update = {p['formula']}  ({hyper}; eps in {p['state_dtype']} = "
                         f"{_num(p['eps_in_dtype'])})")
        else:
            lines.append("    no formula is known for this optimizer; state: "
                         + ", ".join(f"{k} {v['dtype']}" for k, v in p["state"].items()))
        for ex in p["examples"][:shown]:
            lines.append("    at " + str(ex["index"]) + ": " + ", ".join(f"{k} {_num(v)}" for k, v in ex.items()
                                                                        if k != "index"))
    if len(u["params"]) > 8:
        lines.append(f"  ... and {len(u['params']) - 8} more parameters")
    if u.get("clip_signature"):
        lines.append("  every finite gradient element is exactly 0 beside the NaN ones: clip_grad_norm_ over an "
                     "infinite total norm (clip coefficient 0, and 0 * inf = NaN)")
    return lines


def _table(trace, center: int, ops: int) -> str:
    half = max(ops // 2, 1)
    lo, hi = max(0, center - half), min(len(trace.records), center + half + 1)
    rows = [("", "#", "phase", "op", "module", "dtypes", "in abs-max", "out abs-max", "source")]
    for i in range(lo, hi):
        rec = trace.records[i]
        ins = [trace.absmax[s] for s, _ in rec.inputs]
        outs = [trace.absmax[s] for s in rec.outputs]
        rows.append((">>" if i == center else "", str(i), rec.phase[:3], rec.name, rec.module, _dtypes(rec),
                     _num(_mx(ins)), _num(_mx(outs)), rec.source or "-"))
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _dtypes(rec) -> str:
    """``float32 -> float16``: an op's floating input dtypes (sorted, comma-joined) and its output dtype, so a
    cast reads as one; ``-`` for an op with no floating input or output (a mask's bool ops)."""
    ins = ",".join(sorted(str(d).removeprefix("torch.") for d in rec.in_dtypes)) or "-"
    out = str(rec.out_dtype).removeprefix("torch.") if rec.out_dtype is not None else "-"
    return "-" if ins == out == "-" else f"{ins} -> {out}"


def _mx(vals):
    if not vals:
        return None
    if any(math.isnan(v) for v in vals):
        return float("nan")
    return max(vals)


def plot_replay(result: ReplayResult, path: str | os.PathLike) -> str:
    """Write a PNG of ``replay_plot.plot_replay_ops``: per-op output abs-max along execution order, one
    line per precision, the forward/backward boundary, the culprit, and a zoom on the ops around it.

    An update snapshot's result (``result.update`` set, no forward/backward runs) gets
    ``update_plot.plot_update_forensics`` instead: per parameter, the factor that made its
    elements NaN/Inf and the values the update read there.

    Written atomically (a crash leaves the old file or the new one).
    """
    import io

    from .outputs import atomic_write_bytes
    from .plots import plt  # the Agg backend is chosen there, once

    fig = replay_figure(result)
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return os.fspath(path)


def replay_figure(result: ReplayResult):
    """The matplotlib Figure ``plot_replay`` writes: the per-op figure of a forward/backward
    replay, or the update forensics' figure when ``result.update`` is set (no runs to draw)."""
    from .replay_plot import plot_replay_ops
    from .update_plot import plot_update_forensics

    return plot_update_forensics(result) if result.update is not None else plot_replay_ops(result)


def _fp8_lines(f: dict) -> list[str]:
    """The FP8 run beside the others, the casts that broke (at most 8) and the per-token error of each Linear."""
    roles = ", ".join(f"{k} {v.get('format')} {v.get('granularity')}" for k, v in f["roles"].items())
    agree = "agrees with BF16" if f["agrees_with_bf16"] else "does not agree with BF16"
    lines = [f"  {'fp8':<9} loss {_num(f['losses'].get('fp8')):>10}  {agree} ({len(f['modules'])} modules: {roles})"]
    t = f["thresholds"]
    broken = f["breaking"]
    lines += ["", f"fp8 casts: {f['casts']}, {len(broken)} broken (flushed > {t['flushed_frac']:.0%} of the non-zero "
              f"values, or saturated > {t['saturated_frac']:.2%})" + (":" if broken else "")]
    for c in broken[:8]:
        what = (f"{c['flushed_frac']:.1%} flushed" if c["breaks"] == "underflow"
                else f"{c['saturated']} of {c['numel']} saturated")
        lines.append(f"  {c['module']} {c['role'] or 'operand'} ({c['use'] or '-'} GEMM, {c['phase']} pass, {c['fmt']} "
                     f"{c['granularity']}): {what}; amax {_num(c['amax'])} at row {c['outlier']['row']}, "
                     f"channel {c['outlier']['column']}")
    if len(broken) > 8:
        lines.append(f"  ... and {len(broken) - 8} more (--json)")
    jump = (f.get("jump") or {}).get("layer")
    outs = ", ".join(f"{o['layer']} {_num(o['rel_err_bf16'])}" + (" <-" if o["layer"] == jump else "")
                     for o in f["outputs"])
    lines.append(f"  Linear outputs against BF16, per token (median; tolerance {t['output_rel_err']}): {outs}")
    return lines

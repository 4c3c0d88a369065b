"""``analyzer demo``: train a bundled failing run, then autopsy it, end to end, in under a minute.

The demo is the product in one command: a sample scenario from ``samples/`` trains with the
recorder on (progress shown), then ``analyzer autopsy`` answers why it failed: it reports the
trace, replays the failing snapshots in FP32 and the run's precision, and tries each fix on the
failing step. Everything lands in one folder::

    OUT/SCENARIO/               the run directory (meta.json, trace/, snapshots/)
    OUT/SCENARIO-plots/*.png    the report's plots
    OUT/SCENARIO.html           the self-contained HTML page
    OUT/SCENARIO-replay.png     per-op abs-max of the replayed step, per precision

Example:
    >>> from analyzer.demo import run_demo
    >>> out = run_demo("amp-autopsy-demo")  # doctest: +SKIP
    >>> out.replay.verdict, out.replay.culprit["module"]  # doctest: +SKIP
    ('overflow', 'blocks.0.attn')
"""
from __future__ import annotations

import importlib
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from recorders import imports, schema

from .errors import AnalyzerError
from .load import samples_package, samples_roots

if TYPE_CHECKING:
    from .autopsy import AutopsyResult
    from .replay import ReplayResult
    from .report import Report

__all__ = ["SCENARIOS", "DemoOutput", "run_demo"]

# The bundled scenarios, one module each under samples/ (see the README's scenario table).
SCENARIOS = (
    "fp16_attention_overflow",
    "log_zero",
    "masked_padding",
    "custom_op_outside_autocast",
    "stalled_layers",
    "loss_outside_autocast",
    "bf16_nan",
    "healthy",
)


@dataclass
class DemoOutput:
    """Where ``run_demo`` put everything, and what the report and the replay concluded."""

    out_dir: Path
    run_dir: Path
    report: Report
    replay: ReplayResult | None  # the autopsy's primary replay; None when the run wrote no failure snapshot
    snapshot: Path | None
    plots: list[Path] = field(default_factory=list)
    html: Path | None = None
    replay_plot: Path | None = None
    autopsy: AutopsyResult | None = None


def run_demo(out_dir: str | Path, *, scenario: str = "fp16_attention_overflow",
             echo: Callable[[str], object] = print) -> DemoOutput:
    """Run `scenario`, print its autopsy (answer, report, replay), write plots and HTML.

    Args:
        out_dir: folder for the run, plots and report (created; a previous demo run of the
            same scenario in it is replaced, anything else there is left alone).
        scenario: one of ``SCENARIOS``.
        echo: where text goes (``click.echo`` from the CLI).

    Raises:
        AnalyzerError: unknown scenario, or `out_dir/SCENARIO` holds something that is not a run.
    """
    if scenario not in SCENARIOS:
        raise AnalyzerError(f"unknown scenario {scenario!r}; choose one of: {', '.join(SCENARIOS)}",
                            fix="pass --scenario NAME")
    from .autopsy import run_autopsy
    from .render import render_autopsy_text, write_autopsy_outputs

    with imports.import_roots(samples_roots()):  # a checkout's samples/, found even from elsewhere
        module = importlib.import_module(f"{samples_package()}.{scenario}")
    one_thread = importlib.import_module(f"{module.__package__}._common").one_thread
    out = Path(out_dir)
    run_dir = out / scenario
    _clear_previous_run(run_dir)
    summary = (module.__doc__ or scenario).strip().splitlines()[0]

    echo(f"amp-autopsy demo: {scenario}")
    echo(f"  {summary}")
    echo(f"\n[1/2] training with the recorder on, into {run_dir}")
    module.run(run_dir, progress=echo)

    with one_thread():
        echo(f"\n[2/2] analyzer autopsy {run_dir} --device cpu")
        autopsy = run_autopsy(run_dir, device="cpu", progress=sys.stderr.isatty())
        echo(render_autopsy_text(autopsy))
        written = write_autopsy_outputs(autopsy, plots_dir=out / f"{scenario}-plots",
                                        primary_plot=out / f"{scenario}-replay.png", html=out / f"{scenario}.html",
                                        run_dir=run_dir)
        result = autopsy.primary
        snapshot = Path(result.snapshot) if result is not None else None
        plots, html = written.plots, written.html
        replay_png = written.replay_plots[0] if written.replay_plots else None
        if result is None:
            echo("\nno snapshot: the run never failed, so there is no step to replay")

    echo("\nwhere everything is:")
    echo(f"  run directory  {run_dir}")
    if snapshot is not None:
        echo(f"  snapshot       {snapshot}")
    for p in plots:
        echo(f"  plot           {p}")
    if replay_png is not None:
        echo(f"  replay plot    {replay_png}")
    echo(f"  html page      {html}")
    echo(f"next: analyzer autopsy {run_dir} --json"
         + (f"   |   analyzer replay {snapshot} --ops 12" if snapshot is not None else ""))
    return DemoOutput(out_dir=out, run_dir=run_dir, report=autopsy.report, replay=result, snapshot=snapshot,
                      plots=[Path(p) for p in plots], html=Path(html), replay_plot=replay_png, autopsy=autopsy)


def _clear_previous_run(run_dir: Path) -> None:
    """Remove a run directory a previous demo wrote; refuse to touch anything else."""
    if not run_dir.exists():
        return
    meta = run_dir / schema.META_FILE
    try:
        ours = json.loads(meta.read_text()).get("format") == schema.META_FORMAT
    except (OSError, ValueError, AttributeError):
        ours = False
    if not ours:
        raise AnalyzerError("exists and is not an amp-autopsy run directory; the demo will not overwrite it",
                            path=run_dir, fix="pass another --out")
    shutil.rmtree(run_dir)


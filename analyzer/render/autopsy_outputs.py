"""The files an autopsy writes: the report's plots, each replay's figure, the HTML page.

``analyzer autopsy --out DIR --html FILE`` and ``analyzer demo`` write the same three kinds of
file, each from the function that draws it (``write_plots``, ``plot_replay``,
``write_autopsy_html``); only where they go differs, so that is all the caller passes.

Example (the demo run, as ``analyzer autopsy RUN --out out --html out/autopsy.html`` writes it):
    >>> out = write_autopsy_outputs(result, plots_dir="out", replays_dir="out",  # doctest: +SKIP
    ...                             html="out/autopsy.html")
    >>> [p.name for p in out.figures]  # doctest: +SKIP
    ['loss_scale.png', 'grad_heatmap.png', 'stalled_fraction.png', 'grad_vs_depth.png',
     'step00000024-r00000-nonfinite_loss-replay.png', 'step00000031-r00000-overflow_streak-replay.png',
     'step00000037-r00000-scale_collapse-replay.png']
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .autopsy_html import write_autopsy_html
from .replay import plot_replay
from .report import write_plots

if TYPE_CHECKING:
    from ..autopsy import AutopsyResult

__all__ = ["AutopsyOutputs", "write_autopsy_outputs"]


@dataclass(frozen=True)
class AutopsyOutputs:
    """What ``write_autopsy_outputs`` wrote, in the order it wrote them."""

    plots: tuple[Path, ...] = ()         # the report's figures
    replay_plots: tuple[Path, ...] = ()  # one figure per replay written
    html: Path | None = None

    @property
    def figures(self) -> tuple[Path, ...]:
        """Every PNG written: the report's plots, then the replays'."""
        return self.plots + self.replay_plots


def _run_dir(autopsy: AutopsyResult) -> Path:
    """The folder the page's snapshot links start from: the run (a meta.json, a log or a checkpoint: its folder)."""
    run = Path(autopsy.run)
    return run.parent if run.is_file() else run


def write_autopsy_outputs(autopsy: AutopsyResult, *, plots_dir: str | os.PathLike | None = None,
                          replays_dir: str | os.PathLike | None = None,
                          primary_plot: str | os.PathLike | None = None,
                          html: str | os.PathLike | None = None,
                          run_dir: str | os.PathLike | None = None) -> AutopsyOutputs:
    """Write the autopsy's files; each is left out when its destination is None.

    Args:
        autopsy: the ``AutopsyResult`` to draw.
        plots_dir: the report's plots go here (created); nothing without a report.
        replays_dir: each replay's figure goes here, as ``SNAPSHOT_STEM-replay.png``.
        primary_plot: the primary replay's figure goes to this file (the demo's one figure).
        html: the self-contained page (``write_autopsy_html``).
        run_dir: where the page looks for snapshots not found at their recorded path; default:
            the run itself (its folder when it is a file).
    """
    plots: tuple[Path, ...] = ()
    if plots_dir is not None and autopsy.report is not None:
        plots = tuple(write_plots(autopsy.report, plots_dir))
    replay_plots: list[Path] = []
    if replays_dir is not None:
        replay_plots += [Path(plot_replay(r, Path(replays_dir) / f"{Path(r.snapshot).stem}-replay.png"))
                         for r in autopsy.replays]
    if primary_plot is not None and autopsy.primary is not None:
        replay_plots.append(Path(plot_replay(autopsy.primary, primary_plot)))
    page = None
    if html is not None:
        page = Path(write_autopsy_html(html, autopsy.to_dict(), report=autopsy.report,
                                       replays=list(autopsy.replays),
                                       run_dir=_run_dir(autopsy) if run_dir is None else run_dir))
    return AutopsyOutputs(plots=plots, replay_plots=tuple(replay_plots), html=page)

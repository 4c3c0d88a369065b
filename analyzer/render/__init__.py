"""Text, HTML and figures for every command, from the analyses' result objects.

The one layer that draws or formats for people: nothing in ``load``, ``replay``, ``report`` or
``inspect`` imports it. Output files are written atomically and never over an input
(``outputs``); matplotlib is imported only when a figure is drawn (``plots``).
"""
from __future__ import annotations

from .autopsy import render_autopsy_text
from .autopsy_html import write_autopsy_html
from .autopsy_outputs import AutopsyOutputs, write_autopsy_outputs
from .import_plan import render_import_plan
from .inspect import render_inspect_text
from .outputs import atomic_write_bytes, atomic_write_text, check_output_path
from .replay import plot_replay, render_replay_text
from .report import render_report_text, write_html, write_plots
from .window import render_window_text

__all__ = ["AutopsyOutputs", "atomic_write_bytes", "atomic_write_text", "check_output_path", "plot_replay",
           "render_autopsy_text", "render_import_plan", "render_inspect_text", "render_replay_text",
           "render_report_text", "render_window_text", "write_autopsy_html", "write_autopsy_outputs", "write_html", "write_plots"]

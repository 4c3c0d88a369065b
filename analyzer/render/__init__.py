"""Text, HTML and figures for every command, from the analyses' result objects.

The one layer that draws or formats for people: nothing in ``load``, ``replay``, ``report`` or
``inspect`` imports it. Output files are written atomically and never over an input
(``outputs``); matplotlib is imported only when a figure is drawn (``plots``).
"""
from __future__ import annotations

from .autopsy import render_autopsy_text
from .autopsy_html import write_autopsy_html
from .inspect import render_inspect_text
from .outputs import atomic_write_bytes, atomic_write_text, check_output_path
from .replay import plot_replay, render_replay_text
from .report import render_report_text, write_html, write_plots

__all__ = ["atomic_write_bytes", "atomic_write_text", "check_output_path", "plot_replay", "render_inspect_text",
           "render_autopsy_text", "render_replay_text", "render_report_text", "write_autopsy_html", "write_html",
           "write_plots"]

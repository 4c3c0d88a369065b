"""One command, one answer: report a run, replay the snapshots that matter, try the fixes on them.

The public surface is ``run_autopsy`` (run every stage) and ``AutopsyResult`` (what it found,
with ``to_dict()`` for strict JSON); ``pick_snapshots`` is the snapshot choice on its own.
``analyzer.render.render_autopsy_text`` draws it.
"""
from __future__ import annotations

from .autopsy import run_autopsy
from .result import AUTOPSY_VERSION, AutopsyResult, SnapshotFailure
from .pick import pick_snapshots

__all__ = ["AUTOPSY_VERSION", "AutopsyResult", "SnapshotFailure", "pick_snapshots", "run_autopsy"]

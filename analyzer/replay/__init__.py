"""Differential replay of a failing step: which op made the first NaN/Inf, in which module, and why.

The public surface is ``replay_snapshot`` (run it), ``ReplayResult`` (what it found, with
``to_dict()`` for strict JSON); ``analyzer.render`` draws it.
"""
from __future__ import annotations

from .fixes import FIX_STATUSES, Advice, Fix, advice_with_status, try_fixes
from .records import Culprit, OpRecord
from .replay import replay_snapshot
from .result import VERDICTS, ReplayResult

__all__ = ["replay_snapshot", "try_fixes", "advice_with_status", "Fix", "Advice", "FIX_STATUSES", "Culprit", "OpRecord", "ReplayResult", "VERDICTS"]

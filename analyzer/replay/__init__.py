"""Differential replay of a failing step: which op made the first NaN/Inf, in which module, and why.

The public surface is ``Replay`` (one snapshot's replay, owning the rebuilt model: ``run()``,
``try_fixes(result)``), ``replay_snapshot`` (``Replay(path).run()``), ``ReplayResult`` (what it
found, with ``to_dict()`` for strict JSON), the verdict registry ``VERDICTS`` (``verdicts.py``)
and the fix registry ``FIXES`` (``fixes.py``); ``analyzer.render`` draws the result.
"""
from __future__ import annotations

from . import _builtin_verdicts  # noqa: F401  (fills VERDICTS with the built-in verdicts, first)
from . import _builtin_fixes  # noqa: F401  (fills FIXES with the built-in fixes, in the order they are tried)
from . import _scaler_skip  # noqa: F401  (registers the fix scaler_skip in FIXES)
from ._advice import advice_with_status
from .diagnosis import Diagnosis, PrecisionRun, SdpaCheck
from .fixes import FIX_STATUSES, FIXES, Advice, Fix, FixSpec, register_fix
from .records import Culprit, OpRecord
from .replay import Replay, replay_snapshot, try_fixes
from .result import ReplayResult
from .verdicts import VERDICTS, AdviceLine, Verdict, register

__all__ = ["Replay", "replay_snapshot", "try_fixes", "advice_with_status", "Fix", "Advice", "FIX_STATUSES",
           "Culprit", "OpRecord", "ReplayResult", "VERDICTS", "Verdict", "AdviceLine", "register", "FIXES",
           "FixSpec", "register_fix", "Diagnosis", "SdpaCheck", "PrecisionRun"]

"""Differential replay of a failing step: which op made the first NaN/Inf, in which module, and why.

The public surface is ``Replay`` (one snapshot's replay, owning the rebuilt model: ``run()``,
``try_fixes(result)``), ``replay_snapshot`` (``Replay(path).run()``), ``ReplayResult`` (what it
found, with ``to_dict()`` for strict JSON), the verdict registry ``VERDICTS`` (``verdicts.py``),
the fix registry ``FIXES`` (``fixes.py``) and the probe registry ``PROBES`` (``probes/``: the
evidence gathered around a verdict); ``analyzer.render`` draws the result.
"""
from __future__ import annotations

# The modules that register the built-in verdicts, fixes and probes; their order in the registries is
# verdicts.ORDER, fixes.ORDER and probes.registry.ORDER, not this import order.
from . import _born_fix, _builtin_fixes, _builtin_verdicts, _cancellation, _region_fix, _scaler_skip, probes  # noqa: F401
from .compiled import fix, verdict  # noqa: F401
from .fp8 import fixes as _fp8_fixes, verdicts as _fp8_verdicts  # noqa: F401
from ._advice import advice_with_status
from .diagnosis import Diagnosis, PrecisionRun, SdpaCheck
from .fixes import FIX_STATUSES, FIXES, Advice, Fix, FixSpec, register_fix
from .records import Culprit, OpRecord
from .replay import Replay, replay_snapshot, try_fixes
from .result import ReplayResult
from .probes import PROBES, ProbeInput, probe
from .verdicts import VERDICTS, AdviceLine, Verdict, register

__all__ = ["Replay", "replay_snapshot", "try_fixes", "advice_with_status", "Fix", "Advice", "FIX_STATUSES",
           "Culprit", "OpRecord", "ReplayResult", "VERDICTS", "Verdict", "AdviceLine", "register", "FIXES",
           "FixSpec", "register_fix", "Diagnosis", "SdpaCheck", "PrecisionRun", "PROBES", "ProbeInput", "probe"]

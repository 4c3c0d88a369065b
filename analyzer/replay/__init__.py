"""Differential replay of a failing step: which op made the first NaN/Inf, in which module, and why.

The public surface is ``Replay`` (one snapshot's replay, owning the rebuilt model: ``run()``,
``try_fixes(result)``), ``replay_snapshot`` (``Replay(path).run()``), ``ReplayResult`` (what it
found, with ``to_dict()`` for strict JSON), the verdict registry ``VERDICTS`` (``verdicts/registry.py``),
the fix registry ``FIXES`` (``fixes/registry.py``) and the probe registry ``PROBES`` (``probes/``: the
evidence gathered around a verdict); ``analyzer.render`` draws the result.
"""
from __future__ import annotations

# The modules that register the built-in verdicts, fixes and probes; their order in the registries is
# verdicts.ORDER, fixes.ORDER and probes.registry.ORDER, not this import order.
from .fixes import _born as _born_fix, _builtin as _builtin_fixes  # noqa: F401
from .verdicts import _builtin as _builtin_verdicts, _cancellation  # noqa: F401
from .fixes import _region as _region_fix, _reduce as _reduce_fix, _scaler_skip  # noqa: F401
from . import probes  # noqa: F401
from .compiled import fix, verdict  # noqa: F401
from .fp8 import fixes as _fp8_fixes, verdicts as _fp8_verdicts  # noqa: F401
from .verdicts._advice import advice_with_status
from .result.diagnosis import Diagnosis, PrecisionRun, SdpaCheck
from .fixes.registry import FIX_STATUSES, FIXES, Advice, Fix, FixSpec, register_fix
from .result.records import Culprit, OpRecord
from .replay import Replay, replay_snapshot, try_fixes
from .result.replay_result import ReplayResult
from .probes import PROBES, ProbeInput, probe
from .verdicts.registry import VERDICTS, AdviceLine, Verdict, register

__all__ = ["Replay", "replay_snapshot", "try_fixes", "advice_with_status", "Fix", "Advice", "FIX_STATUSES",
           "Culprit", "OpRecord", "ReplayResult", "VERDICTS", "Verdict", "AdviceLine", "register", "FIXES",
           "FixSpec", "register_fix", "Diagnosis", "SdpaCheck", "PrecisionRun", "PROBES", "ProbeInput", "probe"]

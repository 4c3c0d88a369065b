"""amp-autopsy analyzer: offline diagnosis of mixed-precision training failures.

Commands (see ``analyzer --help``): ``autopsy``, ``replay``, ``report``, ``inspect``, ``demo``.
"""
from __future__ import annotations

from .errors import AnalyzerError, BadInputError, FactoryError, VersionError

__all__ = ["AnalyzerError", "BadInputError", "FactoryError", "VersionError"]

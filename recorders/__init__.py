"""amp-autopsy recorders: per-step AMP traces and failure-step snapshots, inside training.

Imports torch and polars only.
"""
from __future__ import annotations

__version__ = "0.1.0"

from .recorder import Recorder  # noqa: E402

__all__ = ["Recorder", "__version__"]

"""amp-autopsy recorders: per-step AMP traces and failure-step snapshots, inside training.

Imports torch and polars only. ``Recorder`` is imported lazily, so that the analyzer can read
``recorders.schema`` (the on-disk contract) without paying for ``import torch``.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Recorder", "__version__"]


def __getattr__(name: str):
    if name == "Recorder":
        from .recorder import Recorder

        return Recorder
    raise AttributeError(f"module 'recorders' has no attribute {name!r}")

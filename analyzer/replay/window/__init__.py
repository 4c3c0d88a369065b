"""The rewind window's replay (``analyzer replay SNAPSHOT --steps K``): FP32 and the run's precision, step by step.

``replay_window(Replay(path), K)`` -> ``WindowResult``; ``require_window`` refuses a snapshot without a window.
"""
from __future__ import annotations

from .result import WindowResult
from .window import replay_window, require_window

__all__ = ["WindowResult", "replay_window", "require_window"]

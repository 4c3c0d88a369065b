"""A one-line progress bar on stderr for ``analyzer replay``, drawn only when asked for."""
from __future__ import annotations

import sys

__all__ = ["Progress"]


class Progress:
    """A one-line progress bar on stderr, only when asked for."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total, self.i, self.label = enabled, total, 0, ""
        self.ops = self._ops if enabled else None

    def _draw(self, label: str, ops: int | None = None) -> None:
        if not self.enabled:
            return
        self.label = label
        width = 20
        filled = int(width * min(self.i, self.total) / max(self.total, 1))
        count = f" {ops} ops" if ops else ""
        sys.stderr.write(f"\rreplay [{'#' * filled}{'.' * (width - filled)}] {self.i}/{self.total} "
                         f"{label + count:<44}")
        sys.stderr.flush()

    def _ops(self, n: int) -> None:
        self._draw(self.label, n)

    def step(self, label: str) -> None:
        self.i += 1
        self._draw(label)

    def extra(self, label: str) -> None:
        self._draw(label)

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()

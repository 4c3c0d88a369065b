"""The analyzer's error hierarchy. The CLI turns these into one ``Error: ...`` line and exit 1."""
from __future__ import annotations

import os

__all__ = ["AnalyzerError", "BadInputError", "VersionError", "FactoryError"]


class AnalyzerError(Exception):
    """Base class: a problem the user can fix. ``str(e)`` is the one-line message.

    Args:
        message: what is wrong, in plain words.
        path: the file or directory involved, if any.
        fix: what to do about it.
    """

    def __init__(self, message: str, *, path: str | os.PathLike | None = None, fix: str | None = None):
        self.message = message
        self.path = None if path is None else os.fspath(path)
        self.fix = fix
        super().__init__(self.__str__())

    def __str__(self) -> str:
        text = f"{self.path}: {self.message}" if self.path else self.message
        if self.fix:
            text += f" ({self.fix})"
        return " ".join(text.split())  # always one line


class BadInputError(AnalyzerError):
    """A file or directory that is missing, corrupt, truncated, foreign or of an unknown layout."""


class VersionError(AnalyzerError):
    """A file written by a newer (or unknown) format version."""


class FactoryError(AnalyzerError):
    """A factory or loss_fn reference that cannot be imported, or that we refuse to import."""

"""Tests that need an optional extra (``[hf]``, ``[lightning]``, ``[tensorboard]``) skip where it is not
installed, saying which extra: the README's ``pip install -e '.[dev]' && python -m pytest`` passes as
written. Each run records in pytest's cache which tests skipped so; ``python -m pytest
--skipped-for-extras`` runs exactly those again (``.ci/run`` does, once it has installed the extras)."""
from __future__ import annotations

import re

import pytest

__all__ = ["CACHE_KEY", "require", "skipped_for_an_extra"]

CACHE_KEY = "amp-autopsy/skipped_for_extras"
_REASON = re.compile(r"from the \[(\w+)\] extra")


def require(module: str, extra: str):
    """``module``, imported, or the calling test (or module, at top level) skipped: it needs ``extra``."""
    __tracebackhide__ = True  # the skip is reported at the caller's line
    return pytest.importorskip(module, reason=f"needs {module}, from the [{extra}] extra: pip install -e '.[{extra}]'")


def skipped_for_an_extra(report) -> bool:
    """Whether a test or collection report is a skip by ``require``."""
    if not report.skipped:
        return False
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return bool(_REASON.search(reason))

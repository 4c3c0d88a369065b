"""``analyzer report``: a run's trace -> frames -> every registered check -> a ``Report`` of findings.

``checks/`` holds the frames the checks read and one module per family of diagnoses;
``findings`` the ``Finding`` value every analysis returns.
"""
from __future__ import annotations

from ..findings import Finding, json_safe, sort_findings
from .checks.frames import LOG_FLOOR, Frames
from .checks.mistakes import autocast_was_inactive
from .report import EXIT_CHECK_FAILED, EXIT_FAIL_ON, Report, build_report

__all__ = ["EXIT_CHECK_FAILED", "EXIT_FAIL_ON", "Finding", "Frames", "LOG_FLOOR", "Report", "autocast_was_inactive", "build_report",
           "json_safe", "sort_findings"]

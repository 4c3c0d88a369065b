"""findings.exit_status: the one --fail-on gate report, inspect and autopsy share."""
from __future__ import annotations

import pytest

from analyzer.findings import EXIT_FAIL_ON, Finding, exit_status


def _f(severity: str) -> Finding:
    return Finding("some_check", severity, 0, "m")


@pytest.mark.parametrize(("present", "fail_on", "status"), [
    ((), "warning", 0),
    (("info",), "warning", 0),
    (("warning",), "warning", EXIT_FAIL_ON),
    (("warning",), "error", 0),
    (("error",), "warning", EXIT_FAIL_ON),   # an error is worse than a warning
    (("error", "info"), "error", EXIT_FAIL_ON),
    (("error",), None, 0),                   # no --fail-on: never 4
])
def test_fail_on_matches_that_severity_or_worse(present, fail_on, status):
    assert exit_status([_f(s) for s in present], fail_on) == status


def test_fail_on_status_is_4_and_an_unknown_severity_is_refused():
    assert EXIT_FAIL_ON == 4  # the documented exit code of every --fail-on
    with pytest.raises(ValueError, match="fail_on"):
        exit_status([_f("error")], "fatal")

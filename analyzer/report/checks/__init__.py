"""Trace checks: pure functions ``Frames -> list[Finding]``, listed in one registry.

The check names (the registry's keys) are a stable contract: ``--json`` output carries them.
``run_checks`` is the last line of defence: a check that raises becomes one ``check_failed``
error finding (naming the check, asking for a bug report) and the other checks still run, so
one bug never hides every other diagnosis. An ``AnalyzerError`` (a damaged trace part that a
check's own query read first) is bad input, not a bug: it propagates.
"""
from __future__ import annotations

from collections.abc import Callable

from ...errors import AnalyzerError
from ...findings import Finding
from .exceptions import exception
from .fp8 import fp8_casts
from .frames import Frames, build_frames
from .gradients import exploding_gradients, grad_underflow, stalled_layers, vanishing_gradients
from .learning import flat_loss, tiny_updates
from .loss import loss_spike, low_precision_loss, nonfinite_loss
from .mistakes import autocast_inactive, scaled_loss
from .nonfinite import nonfinite_grads
from .plausible import implausible_trace, repeated_steps
from .recorder_warnings import recorder_warning
from .ranks import rank_divergence, repeated_rank_failure
from .scaler import frequent_overflow, scale_collapse, startup_calibration
from .updates import nonfinite_weights, stalled_updates
from .weights import weights_exploded

__all__ = ["CHECKS", "CHECK_FAILED", "Frames", "build_frames", "run_checks"]

CHECK_FAILED = "check_failed"  # the finding a check that raised becomes (not a registry key)

CHECKS: dict[str, Callable[[Frames], list[Finding]]] = {
    "scale_collapse": scale_collapse,
    "frequent_overflow": frequent_overflow,
    "startup_calibration": startup_calibration,
    "nonfinite_loss": nonfinite_loss,
    "nonfinite_grads": nonfinite_grads,
    "loss_spike": loss_spike,
    "stalled_layers": stalled_layers,
    "vanishing_gradients": vanishing_gradients,
    "exploding_gradients": exploding_gradients,
    "grad_underflow": grad_underflow,
    "low_precision_loss": low_precision_loss,
    "rank_divergence": rank_divergence,
    "repeated_rank_failure": repeated_rank_failure,
    "nonfinite_weights": nonfinite_weights,
    "stalled_updates": stalled_updates,
    "exception": exception,
    "weights_exploded": weights_exploded,
    "scaled_loss": scaled_loss,
    "autocast_inactive": autocast_inactive,
    "implausible_trace": implausible_trace,
    "repeated_steps": repeated_steps,
    "recorder_warning": recorder_warning,
    "tiny_updates": tiny_updates,
    "flat_loss": flat_loss,
    "fp8_casts": fp8_casts,
}


def run_checks(frames: Frames, only: list[str] | None = None) -> list[Finding]:
    """Run every registered check (or those named in `only`) and return all findings."""
    out: list[Finding] = []
    for name, check in CHECKS.items():
        if only is None or name in only:
            try:
                found = list(check(frames))
            except AnalyzerError:  # a damaged part met by the check's own query: the run's error, not a bug
                raise
            except Exception as e:  # noqa: BLE001 - the last line of defence: any bug in one check
                out.append(_failed(name, e))
                continue
            out.extend(found)
    return out


def _failed(name: str, e: Exception) -> Finding:
    text = " ".join(str(e).split())[:300]
    return Finding(CHECK_FAILED, "error", None,
                   f"the check {name!r} failed ({type(e).__name__}: {text}), so the report lacks its "
                   "diagnosis; the other checks ran. This is a bug in amp-autopsy: please report it "
                   "with this run's meta.json and trace/ (or the log file)",
                   {"check": name, "error_type": type(e).__name__, "error": text})

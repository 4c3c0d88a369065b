"""Trace checks: pure functions ``Frames -> list[Finding]``, listed in one registry.

The check names (the registry's keys) are a stable contract: ``--json`` output carries them.
"""
from __future__ import annotations

from collections.abc import Callable

from ..findings import Finding
from .frames import Frames, build_frames
from .gradients import exploding_gradients, grad_underflow, stalled_layers, vanishing_gradients
from .loss import loss_spike, low_precision_loss, nonfinite_loss
from .ranks import rank_divergence
from .scaler import frequent_overflow, scale_collapse

__all__ = ["CHECKS", "Frames", "build_frames", "run_checks"]

CHECKS: dict[str, Callable[[Frames], list[Finding]]] = {
    "scale_collapse": scale_collapse,
    "frequent_overflow": frequent_overflow,
    "nonfinite_loss": nonfinite_loss,
    "loss_spike": loss_spike,
    "stalled_layers": stalled_layers,
    "vanishing_gradients": vanishing_gradients,
    "exploding_gradients": exploding_gradients,
    "grad_underflow": grad_underflow,
    "low_precision_loss": low_precision_loss,
    "rank_divergence": rank_divergence,
}


def run_checks(frames: Frames, only: list[str] | None = None) -> list[Finding]:
    """Run every registered check (or those named in `only`) and return all findings."""
    out: list[Finding] = []
    for name, check in CHECKS.items():
        if only is None or name in only:
            out.extend(check(frames))
    return out

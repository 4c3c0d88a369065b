"""Float32 L2 norms of many tensors in one fused kernel; exact zero counts for the cold path.

``norm_list`` is the gradients' one read on every recorded step: one ``torch._foreach_norm`` over
all of them. Nothing else on a healthy step reads a whole gradient or a whole parameter: the
zero fractions and the parameter norms come from the update columns' fixed sample of each
gradient and weight (``recorders._sample.UpdateSample``).
``nonzero_counts`` is the exact count the Recorder's cold path takes on a failing step.

NB: a float32 norm is one float32 sum of squares per tensor: measured on Gaussian values it is
within ~1e-6 of the float64 norm at 100K elements, ~5e-5 at 3M and ~1e-3 at 30M (relative). A sum
of squares past float32's range gives an infinite norm even when every element is finite: the
Recorder's cold path measures such a tensor in float64. Cutting large tensors into pieces summed
in float64 was measured at 1.3x the single ``_foreach_norm`` and is not done.

Example:
    >>> norms([torch.tensor([3.0, 0.0, 4.0]), torch.zeros(2)], torch.device("cpu"), True).tolist()
    [5.0, 0.0]
"""
from __future__ import annotations

import torch

__all__ = ["norm_list", "norms", "nonzero_counts"]


def norm_list(tensors: list[torch.Tensor], device: torch.device, fused: bool) -> list[torch.Tensor]:
    """Float32 L2 norm of each tensor, 0-dim on `device`. `fused` (every tensor on one device, none
    float64): one ``_foreach_norm``; else one ``vector_norm`` each.

    NB: a float64 tensor is measured in float64, then rounded: a float32 ``dtype`` would be a
    narrowing that ``vector_norm`` refuses (it stopped the recording of float64 models).
    """
    if fused:
        return list(torch._foreach_norm(tensors, 2, torch.float32))
    return [torch.linalg.vector_norm(t, dtype=None if t.dtype == torch.float64 else torch.float32)
            .to(device, torch.float32) for t in tensors]


def norms(tensors: list[torch.Tensor], device: torch.device, single_device: bool) -> torch.Tensor:
    """Float32 L2 norm of each tensor, stacked on `device`; one fused kernel when possible."""
    if not tensors:
        return torch.empty(0, device=device)
    fused = single_device and torch.float64 not in {t.dtype for t in tensors}
    return torch.stack(norm_list(tensors, device, fused))


def nonzero_counts(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Each tensor's exact non-zero count, int64 on `device` (MPS has no float64), one
    ``count_nonzero`` per tensor: ~2.5x one L2 norm per element; ``(g == 0).sum()`` is 10-40x (bool).
    The cold path's count: a failing step only."""
    return torch.stack([torch.count_nonzero(t).to(device) for t in tensors])

"""Reference values for the inspect scan tests: what real casts do, and tensors that exercise every boundary."""
from __future__ import annotations

import torch

__all__ = ["expected", "edge_values", "STAT_FIELDS"]

STAT_FIELDS = ("nan", "inf", "zeros", "abs_max", "min_nonzero", "fp16_overflow", "fp16_flush", "bf16_overflow",
               "bf16_flush")


def expected(x: torch.Tensor) -> dict:
    """What real ``.half()`` / ``.bfloat16()`` casts do to x: the reference the scan must equal.
    float8 values are first converted to float32 (exact), as the casts need."""
    x = x.float() if x.dtype.itemsize == 1 else x
    fin = x[torch.isfinite(x)]
    h, b = fin.half(), fin.bfloat16()
    nz = fin.abs()[fin != 0]
    return {"nan": int(x.isnan().sum()), "inf": int(x.isinf().sum()), "zeros": int((x == 0).sum()),
            "abs_max": fin.abs().max().item() if fin.numel() else None,
            "min_nonzero": nz.min().item() if nz.numel() else None,
            "fp16_overflow": int(h.isinf().sum()), "fp16_flush": int(((h == 0) & (fin != 0)).sum()),
            "bf16_overflow": int(b.isinf().sum()), "bf16_flush": int(((b == 0) & (fin != 0)).sum())}


def edge_values(seed: int = 0) -> torch.Tensor:
    """Log-uniform magnitudes over the whole float32 range, both signs, plus every cast boundary and its
    float32 neighbours, five zeros (one negative), NaN, inf and -inf: 20,029 values."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.exp(torch.empty(20_000).uniform_(-100, 88, generator=g))
    signs = torch.where(torch.rand(20_000, generator=g) < 0.5, -1.0, 1.0)
    edges = torch.tensor([2.0**-25, 2.0**-24, 65504.0, 65520.0, 2.0**-134, 2.0**-133, (2 - 2.0**-8) * 2.0**127])
    down, up = torch.nextafter(edges, torch.zeros(7)), torch.nextafter(edges, torch.full((7,), torch.inf))
    zeros = torch.tensor([0.0, -0.0, 0.0, 0.0, 0.0])
    return torch.cat([mags * signs, edges, down, up, zeros, torch.tensor([float("nan"), float("inf"), -float("inf")])])

"""FP8 and MX cast statistics: what one scaled cast to float8 saturates, flushes to zero and makes subnormal.

One implementation for every reader of FP8 casts: the FP8 readiness of a BF16 run
(``analyzer fp8-readiness``) and the recorder's per-module FP8 statistics (``recorders/_fp8_watch.py``). Torch only.

The scales follow torchao 0.18's training recipes (``torchao.float8``, ``torchao.prototype.mx_formats``):

| granularity | scale |
|---|---|
| ``tensorwise`` | ``max / max(amax, 1e-12)``, in float64, then float32 (``amax_to_scale``) |
| ``rowwise`` | the same per row (``amax`` along `dim`), rounded down to a power of 2 (the rowwise recipe) |
| ``mxfp8`` | per block of 32 along `dim`: ``2 ** -ceil(log2(block amax / max))`` (e8m0, RCEIL: the MXFP8 training recipes) |
| ``mxfp8_floor`` | per block of 32: ``2 ** (emax - floor(log2(block amax)))`` (FLOOR, ``to_mx``'s default; can saturate) |

NB: a cast to ``float8_e4m3fn`` saturates on torch 2.13's CPU (464, 1e4 and inf become 448), other
builds give NaN: saturation is counted on the scaled values *before* the clamp, never read from the
cast's result. A value that passes the format's max only by the float32 rounding of its own scale
(``amax * (max / amax)``) is not counted.

Example:
    >>> import torch
    >>> x = torch.tensor([[20000.0] + [0.02] * 63])
    >>> s = cast_stats(x, "e4m3", "tensorwise")
    >>> round(s.flushed / s.nonzero, 3)   # 63 of 64 values are below e4m3's smallest subnormal once scaled
    0.984
    >>> cast_stats(x, "e4m3", "rowwise").flushed  # one row: the same amax, the same scale (rounded to 2**-6)
    63
"""
from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["FORMATS", "GRANULARITIES", "MX_BLOCK", "CastStats", "cast_counts", "cast_stats", "fp8_dtype",
           "scaled_counts"]

FORMATS = ("e4m3", "e5m2")
GRANULARITIES = ("tensorwise", "rowwise", "mxfp8", "mxfp8_floor")
MX_BLOCK = 32  # elements per MX scale block (the OCP MX spec's k)
_EPS = 1e-12  # torchao's floor on amax: an all-zero tensor gets a finite scale
_SAT_TOL = 1e-6  # relative: the float32 rounding of max / amax, not saturation
_EXPONENT_BITS = {"e4m3": 0x78, "e5m2": 0x7C}  # the exponent field of each format's byte (0: zero or subnormal)


def fp8_dtype(fmt: str) -> torch.dtype:
    """The torch dtype of a format name (``"e4m3"`` -> ``float8_e4m3fn``)."""
    if fmt == "e4m3":
        return torch.float8_e4m3fn
    if fmt == "e5m2":
        return torch.float8_e5m2
    raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")


@dataclasses.dataclass(frozen=True)
class CastStats:
    """One cast's counts, on the host.

    Attributes:
        fmt, granularity: as passed to ``cast_stats``.
        numel: elements cast; nonzero: those not exactly 0 before the cast.
        amax: the largest |x| (NaN when x holds NaN).
        saturated: elements whose scaled |x| passes the format's max (clamped, or NaN on other builds).
        flushed: non-zero elements that become exactly 0.
        subnormal: elements that become non-zero subnormals (precision lost, not yet zero).
        scale_min, scale_max: the smallest and largest scale the cast used (one for tensorwise).
    """

    fmt: str
    granularity: str
    numel: int
    nonzero: int
    amax: float
    saturated: int
    flushed: int
    subnormal: int
    scale_min: float
    scale_max: float

    @property
    def saturated_frac(self) -> float:
        return self.saturated / self.numel if self.numel else 0.0

    @property
    def flushed_frac(self) -> float:
        return self.flushed / self.nonzero if self.nonzero else 0.0

    @property
    def subnormal_frac(self) -> float:
        return self.subnormal / self.numel if self.numel else 0.0

    @classmethod
    def from_counts(cls, fmt: str, granularity: str, v: list[float]) -> CastStats:
        """From ``cast_counts``'s eight values, read to the host."""
        return cls(fmt, granularity, int(v[0]), int(v[1]), v[2], int(v[3]), int(v[4]), int(v[5]), v[6], v[7])

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(saturated_frac=self.saturated_frac, flushed_frac=self.flushed_frac,
                   subnormal_frac=self.subnormal_frac)
        return out


def _scales(ax: torch.Tensor, fmt: str, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the scale per element's group, broadcastable to `ax`; the groups' amax), from ``ax = |x|`` (2-D: the cast
    runs along its last dim)."""
    fmax = torch.finfo(fp8_dtype(fmt)).max
    if granularity.startswith("mxfp8"):  # ax is (blocks, MX_BLOCK) here; e8m0 scales are powers of 2
        amax = ax.amax(-1, keepdim=True)
        if granularity == "mxfp8":
            return torch.exp2(-torch.ceil(torch.log2(amax / fmax)).clamp(-127, 127)), amax
        emax = math.floor(math.log2(fmax))  # the largest power of 2 of the element format (8 for e4m3)
        exp = torch.floor(torch.log2(amax.clamp(min=2.0 ** -126)))
        return torch.exp2((emax - exp).clamp(-127, 127)), amax
    amax = ax.amax() if granularity == "tensorwise" else ax.amax(-1, keepdim=True)
    scale = (fmax / amax.double().clamp(min=_EPS)).float()
    if granularity == "rowwise":
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale, amax


def cast_counts(x: torch.Tensor, fmt: str, granularity: str = "tensorwise", dim: int = -1) -> torch.Tensor:
    """``[numel, nonzero, amax, saturated, flushed, subnormal, scale_min, scale_max]`` as one float64 tensor.

    Stays on `x`'s device and reads nothing back: a caller batching many casts moves them to the
    host together (one sync). `dim` is the axis a rowwise or MX scale runs along (the reduction
    axis of the matmul that consumes the cast); a tensor of more than 2 dims is flattened around it.
    An MX cast pads a ragged last block with zeros (they count in no fraction).
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    x = x.detach()
    x = x.reshape(1, -1) if x.dim() == 0 else x.movedim(dim, -1)
    x = x.reshape(-1, x.shape[-1]).float()
    numel = x.numel()
    if granularity.startswith("mxfp8"):
        if x.shape[-1] % MX_BLOCK:
            x = torch.nn.functional.pad(x, (0, MX_BLOCK - x.shape[-1] % MX_BLOCK))
        x = x.reshape(-1, MX_BLOCK)
    ax = x.abs()  # NB: the counts depend on magnitudes only (a sign never flushes nor saturates): one |x| for all
    scale, amax = _scales(ax, fmt, granularity)
    return _counts(ax, ax * scale, scale, amax.amax() if numel else None, fmt, numel)


def scaled_counts(x: torch.Tensor, xs: torch.Tensor, scale: torch.Tensor, fmt: str, *,
                  numel: int | None = None) -> torch.Tensor:
    """``cast_counts``'s eight values for a cast whose scaled values `xs` (``x * scale``, before the
    clamp) are known: the FP8 replay reads them from the cast's own ops (``analyzer/replay/fp8``).

    `x` is the cast's input, `scale` its scale (broadcastable to `x`); nothing is read back. `numel`:
    the elements cast, where `x` was padded (MX blocks).
    """
    ax = x.detach().float().abs()
    numel = ax.numel() if numel is None else numel
    return _counts(ax, xs.detach().float().abs(), scale.detach().float(), ax.amax() if numel else None, fmt, numel)


def _counts(ax: torch.Tensor, axs: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None, fmt: str,
            numel: int) -> torch.Tensor:
    """The eight values from the magnitudes `ax` and their scaled copy `axs`, which is clamped in place."""
    dtype = fp8_dtype(fmt)
    fmax = torch.finfo(dtype).max
    saturated = torch.count_nonzero(axs > fmax * (1 + _SAT_TOL))
    # the cast's bits (no sign bit: axs >= 0 or NaN). Not 0: any bit; normal (or inf/NaN): any exponent bit.
    # NB: bit counts, not comparisons of a float copy: 2-3x cheaper on CPU, the same counts
    q = axs.clamp_(max=fmax).to(dtype).view(torch.uint8)
    cast_nonzero = torch.count_nonzero(q)
    nonzero = torch.count_nonzero(ax)
    stats = [
        torch.tensor(float(numel), device=ax.device),
        nonzero,
        amax if amax is not None else torch.zeros((), device=ax.device),
        saturated,
        # |x| * q is non-zero exactly where both are (q is an integer >= 1 there): the non-zero values kept
        nonzero - torch.count_nonzero(ax * q.to(ax.dtype)),
        cast_nonzero - torch.count_nonzero(q & _EXPONENT_BITS[fmt]),
        scale.amin(), scale.amax(),
    ]
    return torch.stack([s.double() for s in stats])


def cast_stats(x: torch.Tensor, fmt: str, granularity: str = "tensorwise", dim: int = -1) -> CastStats:
    """``cast_counts`` read to the host (one sync) as a ``CastStats``."""
    return CastStats.from_counts(fmt, granularity, cast_counts(x, fmt, granularity, dim).tolist())  # NB: a sync

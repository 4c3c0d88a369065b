"""recorders.fp8: the counts of one scaled FP8/MX cast, pinned by hand and checked against torchao's own casts."""
from __future__ import annotations

import math

import pytest
import torch

from recorders.fp8 import GRANULARITIES, cast_counts, cast_stats, fp8_dtype
from tests.extras import require


def test_one_outlier_under_a_tensorwise_scale_flushes_every_small_value():
    # scale 448 / 2e4 = 0.0224: 0.02 becomes 4.5e-4, below half of e4m3's smallest subnormal 2**-9
    x = torch.tensor([[20000.0] + [0.02] * 63])
    s = cast_stats(x, "e4m3", "tensorwise")
    assert (s.numel, s.nonzero, s.flushed, s.saturated, s.amax) == (64, 64, 63, 0, 20000.0)
    assert s.flushed_frac == pytest.approx(63 / 64)


def test_rowwise_scales_isolate_the_row_that_holds_the_outlier():
    x = torch.full((4, 64), 0.02)
    x[1, 0] = 20000.0
    s = cast_stats(x, "e4m3", "rowwise")
    assert s.flushed == 63  # the outlier's own row only
    assert s.scale_min == 2.0 ** -6  # 448 / 2e4 = 0.0224, rounded down to a power of 2
    assert s.scale_max == 2.0 ** 14  # 448 / 0.02 = 22400, rounded down


def test_an_all_zero_tensor_flushes_and_saturates_nothing_and_keeps_a_finite_scale():
    for g in GRANULARITIES:
        s = cast_stats(torch.zeros(3, 64), "e4m3", g)
        assert (s.nonzero, s.flushed, s.saturated, s.subnormal) == (0, 0, 0, 0)
        assert s.flushed_frac == 0.0 and math.isfinite(s.scale_max)


def test_the_largest_value_is_not_saturated_by_its_own_scale_but_floor_mx_scales_saturate():
    torch.manual_seed(0)
    x = torch.randn(16, 64) * 3
    for fmt in ("e4m3", "e5m2"):
        assert cast_stats(x, fmt, "tensorwise").saturated == 0
        assert cast_stats(x, fmt, "rowwise").saturated == 0
        assert cast_stats(x, fmt, "mxfp8").saturated == 0  # RCEIL rounds the scale so the block fits
    # FLOOR: amax * 2**(8 - floor(log2 amax)) lies in [256, 512): a block amax of 1.9 becomes 486 > 448
    blk = torch.full((1, 32), 0.5)
    blk[0, 0] = 1.9
    assert cast_stats(blk, "e4m3", "mxfp8_floor").saturated == 1


def test_nan_propagates_to_amax():
    x = torch.tensor([[1.0, float("nan"), 2.0]])
    assert math.isnan(cast_stats(x, "e4m3", "tensorwise").amax)


def test_a_ragged_mx_row_is_padded_and_the_padding_counts_nowhere():
    s = cast_stats(torch.ones(3, 40), "e4m3", "mxfp8")
    assert (s.numel, s.nonzero, s.flushed) == (120, 120, 0)


def test_dim_picks_the_axis_rowwise_scales_run_along():
    x = torch.full((64, 4), 0.02)
    x[0, 1] = 20000.0
    assert cast_stats(x, "e4m3", "rowwise", dim=-1).flushed == 3      # the outlier's row: 3 others
    assert cast_stats(x, "e4m3", "rowwise", dim=0).flushed == 63      # its column: 63 others


def test_bad_format_or_granularity_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="fmt"):
        cast_counts(torch.ones(2), "e3m4")
    with pytest.raises(ValueError, match="granularity"):
        cast_counts(torch.ones(2), "e4m3", "blockwise")
    with pytest.raises(ValueError, match="fmt"):
        fp8_dtype("fp8")


def _random(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 96, generator=g) * torch.logspace(-5, 4, 96)[torch.randperm(96, generator=g)]
    x[3] = 0.0           # an all-zero row
    x[5, :40] = 0.0      # an all-zero MX block
    return x


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_counts_equal_those_of_torchaos_own_casts(seed, fmt):
    require("torchao", "fp8")
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    x, dt = _random(seed), fp8_dtype(fmt)
    fmax = torch.finfo(dt).max

    def expect(q, scaled):
        q, nz = q.float(), (x != 0).reshape(q.shape)
        return (int((nz & (q == 0)).sum()), int(((q != 0) & (q.abs() < torch.finfo(dt).tiny)).sum()),
                int((scaled.abs() > fmax * (1 + 1e-6)).sum()))

    def ours(g):
        s = cast_stats(x, fmt, g)
        return s.flushed, s.subnormal, s.saturated

    scale = tensor_to_scale(x, dt)
    assert ours("tensorwise") == expect(to_fp8_saturated(x * scale, dt), x * scale)
    scale = tensor_to_scale(x, dt, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1,
                            round_scales_to_power_of_2=True)
    assert ours("rowwise") == expect(to_fp8_saturated(x * scale, dt), x * scale)
    for g, mode in (("mxfp8", ScaleCalculationMode.RCEIL), ("mxfp8_floor", ScaleCalculationMode.FLOOR)):
        e8m0, data = to_mx(x, dt, 32, mode)
        scaled = x.reshape(-1, 32) / e8m0.float().reshape(-1, 1)
        assert ours(g) == expect(data.reshape(-1, 32), scaled)


def _reference_counts(x: torch.Tensor, fmt: str, granularity: str) -> list[float]:
    """The counts read off a float copy of the cast, by comparisons (what cast_counts' bit counts must equal)."""
    from recorders.fp8 import _scales

    x = x.reshape(-1, x.shape[-1]).float()
    numel = x.numel()
    if granularity.startswith("mxfp8"):
        x = torch.nn.functional.pad(x, (0, -x.shape[-1] % 32)).reshape(-1, 32)
    dtype = fp8_dtype(fmt)
    fmax, tiny = torch.finfo(dtype).max, torch.finfo(dtype).tiny
    scale, _ = _scales(x.abs(), fmt, granularity)
    xs = x * scale
    q = xs.clamp(-fmax, fmax).to(dtype).float()
    nz = x != 0
    return [numel, int(nz.sum()), float(x.abs().amax()), int((xs.abs() > fmax * (1 + 1e-6)).sum()),
            int((nz & (q == 0)).sum()), int(((q != 0) & (q.abs() < tiny)).sum()), float(scale.amin()),
            float(scale.amax())]


@pytest.mark.parametrize("seed", range(12))
def test_the_bit_counts_equal_comparisons_of_the_cast_on_zeros_nan_inf_and_tiny_values(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 70, generator=g) * torch.exp(torch.randn(7, 70, generator=g) * 8)  # 1e-30 .. 1e30
    x[0, :5] = 0
    x[3] = 0  # a row of zeros: rowwise scale from the 1e-12 floor
    x[4, 1] = 1e-40  # float32 subnormal
    if seed % 3 == 1:
        x[1, 3] = float("nan")
    if seed % 3 == 2:
        x[2, 4] = -float("inf")
    for fmt in ("e4m3", "e5m2"):
        for gran in GRANULARITIES:
            want = _reference_counts(x, fmt, gran)
            got = cast_counts(x, fmt, gran).tolist()
            assert [v if v == v else "nan" for v in got] == [v if v == v else "nan" for v in want], (fmt, gran)

"""The report's dtype limits are torch.finfo's: the report reads no torch, so its small table is
held against torch here, and half_ulp against the spacing torch itself gives."""
from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzer.inspect._stats import BF16_FLUSH, BF16_OVERFLOW, FP16_FLUSH, FP16_OVERFLOW
from analyzer.report.checks.updates import _MANTISSA, _TINY, half_ulp

DTYPES = ("float16", "bfloat16", "float32", "float64")


def test_the_report_table_is_torch_finfo():
    assert set(_MANTISSA) == set(_TINY) == set(DTYPES)
    for name in DTYPES:
        fi = torch.finfo(getattr(torch, name))
        assert 2.0 ** -_MANTISSA[name] == fi.eps and _TINY[name] == fi.tiny, name


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(DTYPES), st.floats(min_value=1e-30, max_value=1e30, allow_nan=False, allow_infinity=False))
def test_half_ulp_is_half_the_spacing_torch_gives_at_that_magnitude(name, value):
    dtype = getattr(torch, name)
    x = torch.tensor(value, dtype=torch.float64).to(dtype)
    if not (torch.isfinite(x) and x > 0):
        return  # overflowed or flushed in this dtype: no spacing to compare
    up = torch.nextafter(x, torch.tensor(math.inf, dtype=dtype))
    if not torch.isfinite(up):
        return  # the largest finite value: its spacing to inf is not a spacing
    # the spacing of the binade x lies in is the step from x to the next value up (at a power of two,
    # the step down is half as long and belongs to the binade below)
    assert half_ulp(float(x), name) == (float(up) - float(x)) / 2


def test_the_inspect_rounding_bounds_are_where_torch_rounds():
    # float32 neighbours: a float64 one would round twice on the way down (float64 -> float32 -> float16)
    f32 = torch.float32
    for dtype, overflow, flush in ((torch.float16, FP16_OVERFLOW, FP16_FLUSH),
                                   (torch.bfloat16, BF16_OVERFLOW, BF16_FLUSH)):
        at, tiny = torch.tensor(overflow, dtype=f32), torch.tensor(flush, dtype=f32)
        assert float(at) == overflow and float(tiny) == flush  # exact in float32
        assert torch.isinf(at.to(dtype)) and torch.isfinite(torch.nextafter(at, torch.tensor(0.0)).to(dtype))
        assert tiny.to(dtype) == 0 and torch.nextafter(tiny, torch.tensor(1.0)).to(dtype) != 0

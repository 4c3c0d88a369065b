"""The fixed sample's layout: what it follows when parameters are replaced, strided or partly without gradients.

The statistics themselves (exact up to 4096 elements, the sample's own beyond) are tested in
test_norms.py and test_update.py on recorded runs.
"""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from torch import nn

from recorders._sample import UpdateSample, sample_view

CPU = torch.device("cpu")


def test_a_parameter_whose_storage_is_replaced_is_sampled_afresh():
    big, small = nn.Parameter(torch.ones(10_000)), nn.Parameter(torch.ones(3))
    sample = UpdateSample([big, small], CPU)
    sample.measure()
    assert sample.measure().has == [True, True]
    with torch.no_grad():
        big.data = torch.full((20_000,), 2.0)  # a new storage and size, as p.data = ... or module.to() give
    got = sample.measure()
    assert got.has == [False, False]  # every sample starts afresh: nothing to compare with
    # all 20000 elements are 2.0: the sampled norm scaled to the whole parameter is exact
    assert got.norm.tolist() == [pytest.approx(2.0 * math.sqrt(20_000)), pytest.approx(math.sqrt(3))]
    with torch.no_grad():
        big.add_(1.0)
    got = sample.measure()
    assert got.has == [True, True] and got.rms.tolist() == [1.0, 0.0]  # compared with the new storage's sample


def test_a_strided_parameter_larger_than_the_sample_is_sampled_afresh_at_every_call():
    base = torch.arange(20_000, dtype=torch.float32).reshape(200, 100)
    p = nn.Parameter(base[::2])  # 100 x 100, every other row: neither contiguous nor dense
    assert not p.is_contiguous()
    sample = UpdateSample([p], CPU)
    want = sample_view(p.detach()).double()  # a copy in logical order (not a view) for such a tensor
    got = sample.measure()
    assert got.norm.item() == pytest.approx(math.sqrt(want.square().sum().item() * p.numel() / want.numel()),
                                            rel=1e-6)
    with torch.no_grad():
        p.mul_(-1.0)  # written in place: the next call samples the new values
    got = sample.measure()
    assert got.unchanged.item() < 0.01  # every sampled element changed sign (but the single 0.0)
    assert got.rms.item() == pytest.approx(2 * math.sqrt(want.square().mean().item()), rel=1e-6)


def test_gradients_missing_for_some_parameters_give_nan_zero_fractions_only_for_those():
    params = [nn.Parameter(torch.ones(10_000)), nn.Parameter(torch.ones(384)), nn.Parameter(torch.ones(384))]
    sample = UpdateSample(params, CPU)
    g_big, g_small = torch.zeros(10_000), torch.tensor([0.0, 1.0] * 192)
    assert sample.measure([g_big, g_small, g_small]).zero_frac.tolist() == [1.0, 0.5, 0.5]
    got = sample.measure([None, g_small, None]).zero_frac.tolist()
    assert math.isnan(got[0]) and got[1] == 0.5 and math.isnan(got[2])
    assert sample.measure([g_big, g_small, g_small]).zero_frac.tolist() == [1.0, 0.5, 0.5]


def _reference(t: torch.Tensor) -> torch.Tensor:
    """The sample of `t` as the docstring defines it, in float64."""
    return sample_view(t.detach()).reshape(-1).double()


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.sampled_from([(1,), (3,), (384,), (1152,), (4096,), (2, 192), (5000,), (70, 80)]),
                       min_size=1, max_size=9),
       missing=st.one_of(st.just(set()), st.sets(st.integers(0, 8), max_size=3)), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.float16]))
def test_every_layout_measures_what_the_sample_definition_gives(shapes, missing, seed, dtype):
    # equal sizes share rows copied by one torch.cat; the others are copied one by one: both give the same
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
    sample = UpdateSample(params, CPU)
    sample.measure()
    then = [_reference(p) for p in params]
    with torch.no_grad():
        for p in params:  # half the elements move, half keep their bits
            p.add_(torch.randn(p.shape, generator=g).to(dtype) * (torch.rand(p.shape, generator=g) < 0.5))
    grads = [None if i in missing else torch.randn(s, generator=g).to(dtype) * (torch.rand(s, generator=g) < 0.3)
             for i, s in enumerate(shapes)]
    got = sample.measure(grads)
    assert got.has == [True] * len(params)
    for i, p in enumerate(params):
        now = _reference(p)
        assert got.norm[i].item() == pytest.approx(math.sqrt(now.square().sum().item() * p.numel() / now.numel()),
                                                   rel=1e-5)
        assert got.rms[i].item() == pytest.approx(math.sqrt((now - then[i]).square().mean().item()), rel=1e-5)
        assert got.unchanged[i].item() == pytest.approx((now == then[i]).double().mean().item(), abs=1e-7)
        if grads[i] is None:
            assert math.isnan(got.zero_frac[i].item())
        else:
            assert got.zero_frac[i].item() == pytest.approx((_reference(grads[i]) == 0).double().mean().item(),
                                                            abs=1e-7)

"""The fixed sample's layout: what it follows when parameters are replaced, strided or partly without gradients.

The statistics themselves (exact up to 4096 elements, the sample's own beyond) are tested in
test_norms.py and test_update.py on recorded runs.
"""
from __future__ import annotations

import math

import pytest
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

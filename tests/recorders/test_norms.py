"""The layer row's statistics: gradient norms in one read, zero fractions and parameter norms on
the fixed sample, exact counts and norms on failing steps."""
from __future__ import annotations

import gc
import math
import weakref

import polars as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from recorders import Recorder, schema
from recorders._norms import norms
from recorders._sample import SAMPLE, UpdateSample, sample_view
from tests.recorders.models import batches, build_mlp, mse_loss

CPU = torch.device("cpu")


def exact_norms(tensors):
    return [torch.linalg.vector_norm(t.detach().double()).item() for t in tensors]


def zero_sample(grads):
    """The zero fractions UpdateSample measures on `grads` (one per tensor, each its own parameter)."""
    return UpdateSample([nn.Parameter(torch.zeros_like(g)) for g in grads], CPU).measure(grads).zero_frac


def sample_zero_frac(t: torch.Tensor) -> float:
    """The fraction of zeros in `t`'s sample, counted by hand."""
    s = sample_view(t.detach())
    return (s == 0).sum().item() / s.numel()


class Wide(nn.Module):
    """An embedding far larger than the sample (ReLU and unused rows give zeros), a 0-dim and an empty param."""

    def __init__(self, vocab: int = 4000, d: int = 16):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(vocab, d)  # only the rows a batch uses get a non-zero gradient
        self.fc = nn.Linear(d, d)
        self.gain = nn.Parameter(torch.tensor(1.5))  # 0-dim
        self.nothing = nn.Parameter(torch.empty(0))  # empty: a gradient of no elements
        with torch.no_grad():
            for p in (self.emb.weight, self.fc.weight, self.fc.bias):
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, idx):
        return torch.relu(self.fc(self.emb(idx))).mean() * self.gain + self.nothing.sum()


def wide_grads(n_idx: int = 3000):
    model = Wide()
    idx = torch.randint(model.emb.num_embeddings, (n_idx,), generator=torch.Generator().manual_seed(1))
    model(idx).backward()
    return model, [p.grad for p in model.parameters()]


def test_gradient_norms_are_one_foreach_norm_of_the_gradients():
    _, grads = wide_grads()
    assert torch.equal(norms(grads, CPU, True), torch.stack(torch._foreach_norm(grads, 2, torch.float32)))
    assert norms(grads, CPU, True).tolist() == pytest.approx(exact_norms(grads), rel=1e-6)


def test_tensors_on_several_devices_get_one_vector_norm_each():
    _, grads = wide_grads()
    assert torch.equal(norms(grads, CPU, False),
                       torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]))


def test_zero_fractions_are_exact_up_to_the_sample_size_and_the_sample_s_own_beyond():
    model, grads = wide_grads()
    gain, nothing, emb, w, b = grads
    assert emb.numel() > SAMPLE and w.numel() <= SAMPLE
    got = zero_sample(grads).tolist()
    exact = [1.0 - torch.count_nonzero(g).item() / g.numel() if g.numel() else math.nan for g in grads]
    for i in (0, 3, 4):  # all their elements are sampled
        assert got[i] == pytest.approx(exact[i], abs=1e-7)
    assert math.isnan(got[1])  # no elements: no fraction
    assert got[2] == pytest.approx(sample_zero_frac(emb), abs=1e-7)
    assert 0 < got[2] < 1 and 0 < exact[2] < 1  # the embedding has used and unused rows
    assert abs(got[2] - exact[2]) < 0.25  # 64 of its 4000 rows sampled: an estimate


def test_the_sample_keeps_no_gradient_alive_and_follows_new_gradients():
    sampler = UpdateSample([nn.Parameter(torch.ones(10_000)), nn.Parameter(torch.ones(3))], CPU)
    g = torch.zeros(10_000)
    assert sampler.measure([g, None]).zero_frac.tolist()[0] == 1.0
    ref = weakref.ref(g)
    del g
    gc.collect()
    assert ref() is None  # no view of the first step's gradient is kept
    got = sampler.measure([torch.ones(10_000), torch.tensor([0.0, 1.0, 0.0])]).zero_frac.tolist()
    assert got == [0.0, pytest.approx(2 / 3)]  # same layout, new tensors: measured afresh
    assert math.isnan(sampler.measure().zero_frac[0])  # no gradients given: no fraction


_values = st.sampled_from([0.0, -0.0, 1.0, -2.5, 1e-45, -1e-45, 3e38, float("nan"), float("inf")])


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 3 * SAMPLE), min_size=1, max_size=4),
       fill=st.lists(_values, min_size=1, max_size=8), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_zero_fractions_count_exact_zeros_in_the_sample_for_any_values(sizes, fill, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(fill, dtype=torch.float32).to(dtype)
    tensors = [pool[torch.randint(len(fill), (n,), generator=g)] for n in sizes]
    got = zero_sample(tensors).tolist()
    for frac, t in zip(got, tensors):
        if t.numel():
            assert frac == pytest.approx(sample_zero_frac(t), abs=1e-7)  # -0.0 and subnormals: exactly 0 or not
        else:
            assert math.isnan(frac)


def test_sampled_parameter_norms_are_exact_up_to_the_sample_size_and_scaled_beyond():
    model, _ = wide_grads()
    params = list(model.parameters())
    norm = UpdateSample(params, CPU).measure().norm.tolist()
    exact = exact_norms(params)
    for i in (0, 1, 3, 4):
        assert norm[i] == pytest.approx(exact[i], rel=1e-6)
    emb = params[2].detach()
    s = sample_view(emb).double()
    assert norm[2] == pytest.approx(math.sqrt(s.square().sum().item() * emb.numel() / s.numel()), rel=1e-6)
    assert norm[2] == pytest.approx(exact[2], rel=0.1)  # Gaussian weights: the estimate is close


def test_a_nan_weight_in_the_sample_makes_the_sampled_norm_nan():
    w = nn.Parameter(torch.ones(100_000))
    sample = UpdateSample([w], CPU)
    assert sample.measure().norm.tolist() == [pytest.approx(math.sqrt(100_000))]
    with torch.no_grad():
        w[0] = float("nan")  # the first element is always sampled
    assert math.isnan(sample.measure().norm[0])


def test_a_recorded_run_has_exact_columns_on_small_params_and_exact_columns_on_its_failing_step(tmp_path):
    """A real run of the wide model; at step 3 a NaN is written into the embedding's gradient after
    the backward (the optimizer skips that step, as GradScaler would): its layer row counts every
    element and measures every weight."""
    model, seen = Wide(), {}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(2)
    with Recorder(tmp_path, model, optimizer=opt, layer_every=1) as rec:
        for step in range(5):
            idx = torch.randint(model.emb.num_embeddings, (3000,), generator=g)
            rec.begin_step(step, idx)
            loss = model(idx)
            loss.backward()
            if step == 3:
                model.emb.weight.grad[7, 0] = float("nan")
            weights = [p.detach().clone() for p in model.parameters()]
            rec.end_step(loss)
            seen[step] = ([p.grad.clone() for p in model.parameters()], weights)
            if step != 3:
                opt.step()
            opt.zero_grad(set_to_none=True)
    assert not rec.stopped
    layers = pl.read_parquet(tmp_path / schema.TRACE_DIR / "layers-*.parquet").sort(["step", "layer"])
    for step, (grads, weights) in seen.items():
        rows = layers.filter(pl.col("step") == step)
        zf, pn = rows["grad_zero_frac"].to_list(), rows["param_norm"].to_list()
        exact_zf = [1.0 - torch.count_nonzero(t).item() / t.numel() if t.numel() else None for t in grads]
        for i in (0, 3, 4):  # small parameters: the sample is every element
            assert zf[i] == pytest.approx(exact_zf[i], abs=1e-7)
            assert pn[i] == pytest.approx(exact_norms([weights[i]])[0], rel=1e-6)
        if step == 3:  # the failing step: every element counted, every weight measured
            assert zf[2] == pytest.approx(exact_zf[2], abs=1e-7)
            assert pn[2] == pytest.approx(exact_norms([weights[2]])[0], rel=1e-6)
            assert rows["grad_nonfinite"].to_list()[2] == 1
        else:
            assert zf[2] == pytest.approx(sample_zero_frac(grads[2]), abs=1e-7)
            s = sample_view(weights[2]).double()
            assert pn[2] == pytest.approx(math.sqrt(s.square().sum().item() * weights[2].numel() / s.numel()),
                                          rel=1e-6)


def test_the_recorded_zero_fractions_and_counts_equal_count_nonzero_on_healthy_and_nan_steps(tmp_path):
    """A real run of a small MLP (every parameter is sampled whole); at step 3 a NaN and an inf are
    written into two gradients after the backward (the optimizer skips that step)."""
    model, seen = build_mlp(), {}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Recorder(tmp_path, model, optimizer=opt, layer_every=1) as rec:
        for step, batch in enumerate(batches(5)):
            rec.begin_step(step, batch)
            loss = mse_loss(model, batch)
            loss.backward()
            if step == 3:
                model[0].weight.grad[:, 0] = float("nan")
                model[3].bias.grad[1] = float("inf")
            rec.end_step(loss)
            seen[step] = [(1.0 - torch.count_nonzero(p.grad).double().item() / p.numel(),
                           int((~torch.isfinite(p.grad)).sum()), p.grad.double().norm().item())
                          for p in model.parameters()]
            if step != 3:
                opt.step()
            opt.zero_grad(set_to_none=True)
    layers = pl.read_parquet(tmp_path / schema.TRACE_DIR / "layers-*.parquet").sort(["step", "layer"])
    assert seen[3][0][1] == 8 and seen[3][5][1] == 1  # the fault is real: 8 NaNs in 0.weight, one inf in 3.bias
    assert sorted(layers["step"].unique().to_list()) == list(range(5))
    for step, values in seen.items():
        rows = layers.filter(pl.col("step") == step)
        assert rows["grad_zero_frac"].to_list() == pytest.approx([z for z, _, _ in values], abs=1e-7)
        assert rows["grad_nonfinite"].to_list() == [c for _, c, _ in values]
        finite = [(r, n) for r, (_, c, n) in zip(rows["grad_norm"].to_list(), values) if c == 0]
        assert [r for r, _ in finite] == pytest.approx([n for _, n in finite], rel=1e-6)


def test_a_float64_model_is_recorded_with_its_norms_rounded_to_float32(tmp_path):
    """float64 gradients and weights used to stop the recording at the first step (a float32
    vector_norm dtype is a narrowing torch refuses)."""
    model, seen = build_mlp().double(), {}
    data = [{k: v.double() for k, v in b.items()} for b in batches(3)]
    with Recorder(tmp_path, model, layer_every=1) as rec:
        for step, batch in enumerate(data):
            rec.begin_step(step, batch)
            mse_loss(model, batch).backward()
            rec.end_step()
            seen[step] = [(p.grad.norm().float().item(), p.detach().norm().float().item()) for p in model.parameters()]
            model.zero_grad(set_to_none=True)
    assert not rec.stopped
    layers = pl.read_parquet(tmp_path / schema.TRACE_DIR / "layers-*.parquet").sort(["step", "layer"])
    for step, values in seen.items():
        rows = layers.filter(pl.col("step") == step)
        assert rows["grad_norm"].to_list() == [g for g, _ in values]
        assert rows["param_norm"].to_list() == pytest.approx([w for _, w in values], rel=1e-7)


def test_channels_last_gradients_are_sampled_in_memory_order_without_a_copy():
    g = torch.randn(8, 64, 3, 3).to(memory_format=torch.channels_last)
    g[:, ::2] = 0  # half the channels: in memory order every other element is zero
    view = sample_view(g)
    assert view.data_ptr() == g.data_ptr()  # a view of the gradient's own storage
    assert zero_sample([g]).tolist() == [pytest.approx(0.5)]

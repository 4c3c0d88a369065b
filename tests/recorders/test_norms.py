"""GradPass (the gradients' norms and zero counts in one read) against the per-tensor ops it replaced."""
from __future__ import annotations

import math

import polars as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from recorders import Recorder, schema
from recorders._norms import CHUNK, GradPass, norms
from tests.recorders.models import batches, build_mlp, mse_loss

CPU = torch.device("cpu")


def old_pass(tensors):
    """What the Recorder computed before GradPass: a float32 _foreach_norm and count_nonzero per tensor."""
    return (torch.stack(torch._foreach_norm(tensors, 2, torch.float32)),
            torch.stack([torch.count_nonzero(t) for t in tensors]))


def exact_norms(tensors):
    return [torch.linalg.vector_norm(t.detach().double()).item() for t in tensors]


class Wide(nn.Module):
    """An embedding larger than one CHUNK (so it is cut into pieces), ReLU zeros, a 0-dim and an empty param."""

    def __init__(self, vocab: int = 2 * CHUNK // 16 + 7, d: int = 16):
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


def wide_grads():
    model = Wide()
    idx = torch.randint(model.emb.num_embeddings, (64,), generator=torch.Generator().manual_seed(1))
    model(idx).backward()
    return model, [p.grad for p in model.parameters()]


def test_the_fused_pass_counts_exactly_what_count_nonzero_counts_on_a_real_model_cut_into_pieces():
    model, grads = wide_grads()
    gain, nothing, emb = grads[:3]  # a module's own parameters come before its children's
    assert emb.numel() > 2 * CHUNK  # the embedding's gradient is cut into three pieces
    assert gain.dim() == 0 and nothing.numel() == 0
    new_norm, new_nnz = GradPass()(grads, CPU, True, zeros=True)
    old_norm, old_nnz = old_pass(grads)
    assert new_nnz.dtype == torch.float64
    assert new_nnz.tolist() == [float(n) for n in old_nnz.tolist()]
    assert 0 < new_nnz[2] < emb.numel()  # the embedding has zero rows and non-zero rows
    assert new_norm.dtype == torch.float32
    # float32 norms: the old pass's values within its float32 summation error, and the float64
    # norm within float32 rounding (the pieces' sums are short and combined in float64)
    assert new_norm.tolist() == pytest.approx(old_norm.tolist(), rel=1e-4)
    assert new_norm.tolist() == pytest.approx(exact_norms(grads), rel=1e-6)
    # a tensor of one piece keeps the old value bit for bit
    assert [n for n, g in zip(new_norm.tolist(), grads) if g.numel() <= CHUNK] == \
        [n for n, g in zip(old_norm.tolist(), grads) if g.numel() <= CHUNK]


def test_without_zeros_the_pass_gives_the_same_norms_and_no_counts():
    _, grads = wide_grads()
    pass_ = GradPass()
    with_zeros, _ = pass_(grads, CPU, True, zeros=True)
    alone, nnz = pass_(grads, CPU, True, zeros=False)
    assert nnz is None
    assert torch.equal(alone, with_zeros)  # a step's grad_norm does not depend on whether it is a layer row


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_other_gradient_dtypes_keep_the_old_ops_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(300, 7, generator=g).to(dtype), torch.zeros(3, dtype=dtype), torch.tensor(2.0, dtype=dtype)]
    grads[0][::5] = 0
    new_norm, new_nnz = GradPass()(grads, CPU, True, zeros=True)
    old_norm, old_nnz = old_pass(grads)
    assert torch.equal(new_norm, old_norm)
    assert torch.equal(new_nnz, old_nnz)


def test_an_overflowing_piece_gives_an_infinite_norm_like_the_old_pass():
    big = torch.full((10,), 1e20)  # finite elements, sum of squares beyond float32
    nan = torch.tensor([1.0, float("nan"), 0.0])
    inf = torch.tensor([float("inf"), 0.0, 0.0])
    new_norm, new_nnz = GradPass()([big, nan, inf], CPU, True, zeros=True)
    old_norm, _ = old_pass([big, nan, inf])
    assert math.isinf(new_norm[0]) and math.isinf(old_norm[0])  # both go to the Recorder's cold path
    assert math.isnan(new_norm[1]) and math.isinf(new_norm[2])
    # (a NaN's count is not meaningful: sign(NaN) is 0 or NaN; the Recorder recounts failing steps)
    assert new_nnz[2] == 1  # sign(inf) is 1: inf counts as non-zero, as in count_nonzero


def test_non_contiguous_and_channels_last_gradients_are_measured_like_contiguous_ones():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 6, 5, 5, generator=g)
    base[base.abs() < 0.3] = 0
    tensors = [base.to(memory_format=torch.channels_last), base[:, ::2], base.transpose(0, 3)]
    new_norm, new_nnz = GradPass()(tensors, CPU, True, zeros=True)
    assert new_nnz.tolist() == [float(torch.count_nonzero(t)) for t in tensors]
    assert new_norm.tolist() == pytest.approx(exact_norms(tensors), rel=1e-6)


_values = st.sampled_from([0.0, -0.0, 1.0, -2.5, 1e-45, -1e-45, 1e-38, 3e19, -7.25, 1e30])


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 2 * CHUNK + 3), min_size=1, max_size=4),
       fill=st.lists(_values, min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_counts_are_exact_and_finite_norms_are_float32_norms_for_any_values(sizes, fill, seed):
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(fill, dtype=torch.float32)
    tensors = [pool[torch.randint(len(fill), (n,), generator=g)] for n in sizes]
    new_norm, new_nnz = GradPass()(tensors, CPU, True, zeros=True)
    old_norm, old_nnz = old_pass(tensors)
    assert new_nnz.tolist() == [float(n) for n in old_nnz.tolist()]  # subnormals and -0.0 included
    for new, old, exact in zip(new_norm.tolist(), old_norm.tolist(), exact_norms(tensors)):
        if math.isfinite(old):
            assert new == pytest.approx(exact, rel=1e-6)
            # never further from the float64 norm than the old single float32 sum, within rounding
            assert abs(new - exact) <= abs(old - exact) + 1e-6 * exact
        elif math.isfinite(new):  # the old float32 sum overflowed; the pieces, summed in float64, did not
            assert new == pytest.approx(exact, rel=1e-6)


def test_the_recorded_zero_fractions_and_counts_equal_count_nonzero_on_healthy_and_nan_steps(tmp_path):
    """A real run; at step 3 a NaN and an inf are written into two gradients after the backward
    (the optimizer skips that step, as GradScaler would)."""
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
        # the Recorder's formula, float64 then float32: the same count gives the same bits
        assert rows["grad_zero_frac"].to_list() == [torch.tensor(z).float().item() for z, _, _ in values]
        assert rows["grad_nonfinite"].to_list() == [c for _, c, _ in values]
        finite = [(r, n) for r, (_, c, n) in zip(rows["grad_norm"].to_list(), values) if c == 0]
        assert [r for r, _ in finite] == pytest.approx([n for _, n in finite], rel=1e-6)


def test_norms_of_parameters_stay_the_foreach_norm_values():
    model, _ = wide_grads()
    params = [p.detach() for p in model.parameters()]
    assert torch.equal(norms(params, CPU, True), torch.stack(torch._foreach_norm(params, 2, torch.float32)))


@pytest.mark.parametrize("threads", [2, 3])
def test_the_norms_and_counts_do_not_depend_on_the_torch_thread_count(threads):
    _, grads = wide_grads()
    one = GradPass()(grads, CPU, True, zeros=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        many = GradPass()(grads, CPU, True, zeros=True)
        alone, _ = GradPass()(grads, CPU, True, zeros=False)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(many[0], one[0]) and torch.equal(alone, one[0])
    assert torch.equal(many[1], one[1])


def test_tensors_on_several_devices_keep_the_per_tensor_ops():
    """single_device=False (a model split over devices) takes the old per-tensor path; on CPU it
    must give the old values: a float32 vector_norm per tensor and count_nonzero."""
    _, grads = wide_grads()
    new_norm, new_nnz = GradPass()(grads, CPU, False, zeros=True)
    assert torch.equal(new_norm, torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]))
    assert torch.equal(new_nnz, torch.stack([torch.count_nonzero(g) for g in grads]))


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
        assert rows["param_norm"].to_list() == [w for _, w in values]


def test_closing_the_recorder_drops_the_gradient_pass_and_its_scratch_buffer(tmp_path):
    model = nn.Linear(256, 64)  # 16384 weights: above SMALL, so the pass allocates its scratch
    rec = Recorder(tmp_path, model, layer_every=1)
    with rec:
        rec.begin_step(0, None)
        model(torch.randn(4, 256)).square().mean().backward()
        rec.end_step()
        assert rec._grad_pass._scratch is not None and rec._grad_pass._scratch.numel() >= CHUNK
    assert not rec.stopped and "_grad_pass" not in rec.__dict__

"""analyzer inspect's optimizer checks on real checkpoints: optimizer_eps_underflow and lost_updates.

Every checkpoint is a real ``torch.save({"model": ..., "optimizer": ...})`` of a tiny model trained a
few real steps in the dtype under test (no autocast: the parameters themselves are FP16/BF16).
"""
from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from analyzer.cli import main
from analyzer.errors import AnalyzerError
from analyzer.inspect import inspect_checkpoints
from analyzer.inspect._optimizer import eps_in_dtype, half_ulp


def _checks(result) -> list[str]:
    return [f.check for f in result.findings]


def _embedding_ckpt(path, dtype=torch.float16, eps=1e-8):
    """An embedding trained one step on rows 1-3 only (rows 0, 4-9 get exactly zero gradient)."""
    emb = nn.Embedding(10, 4).to(dtype)
    opt = torch.optim.Adam(emb.parameters(), lr=1e-3, eps=eps)
    emb(torch.tensor([1, 2, 3])).float().sum().backward()
    opt.step()
    torch.save({"model": emb.state_dict(), "optimizer": opt.state_dict()}, path)
    return path, emb


def _near_one_ckpt(path, dtype=torch.bfloat16, lr=1e-4, steps=3):
    """A linear layer whose weights are all 1.0, trained `steps` real Adam steps at `lr`."""
    lin = nn.Linear(16, 16).to(dtype)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    opt = torch.optim.Adam(lin.parameters(), lr=lr, eps=1e-6)
    for _ in range(steps):
        opt.zero_grad()
        lin(torch.randn(8, 16, dtype=dtype)).float().pow(2).mean().backward()
        opt.step()
    torch.save({"model": lin.state_dict(), "optimizer": opt.state_dict()}, path)
    return path, lin


def test_eps_in_dtype_rounds_adams_default_to_zero_in_float16_only():
    # 1e-8 is below float16's smallest subnormal (2**-24 ~ 6e-8, half of it rounds to 0), not bfloat16's
    assert eps_in_dtype(1e-8, torch.float16) == 0.0
    assert eps_in_dtype(1e-8, torch.bfloat16) != 0.0
    assert eps_in_dtype(1e-8, torch.float32) != 0.0


def test_half_ulp_of_one_is_half_the_dtype_epsilon():
    # the spacing above 1.0 is finfo.eps by definition
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert half_ulp(torch.ones(1, dtype=dtype)).item() == torch.finfo(dtype).eps / 2


def test_fp16_adam_at_default_eps_gives_optimizer_eps_underflow_naming_the_group_and_dtype(tmp_path):
    path, emb = _embedding_ckpt(tmp_path / "emb.pt")
    assert not torch.isfinite(emb.weight).all()  # the real failure: unused rows went NaN in one step
    result = inspect_checkpoints(path)
    found = [f for f in result.findings if f.check == "optimizer_eps_underflow"]
    assert len(found) == 1
    f = found[0]
    assert f.severity == "warning"
    assert "eps 1e-08 is 0 in float16" in f.message
    assert f.evidence["dtype"] == "float16" and f.evidence["eps_in_dtype"] == 0.0
    assert f.evidence["params"] == ["model.weight"]


def test_fp16_adam_with_an_eps_above_the_smallest_normal_is_quiet(tmp_path):
    path, _ = _embedding_ckpt(tmp_path / "emb.pt", eps=1e-4)
    assert "optimizer_eps_underflow" not in _checks(inspect_checkpoints(path))


def test_fp16_eps_between_zero_and_the_smallest_normal_is_flagged_as_subnormal(tmp_path):
    # 1e-6 is a float16 subnormal: non-zero, below 2**-14 ~ 6.1e-5
    path, _ = _embedding_ckpt(tmp_path / "emb.pt", eps=1e-6)
    f = next(f for f in inspect_checkpoints(path).findings if f.check == "optimizer_eps_underflow")
    assert "below float16's smallest normal" in f.message and f.evidence["eps_in_dtype"] > 0


def test_fp32_adam_at_default_eps_is_quiet(tmp_path):
    path, _ = _embedding_ckpt(tmp_path / "emb.pt", dtype=torch.float32)
    checks = _checks(inspect_checkpoints(path))
    assert "optimizer_eps_underflow" not in checks and "lost_updates" not in checks


def test_bf16_weights_near_one_at_a_small_lr_give_lost_updates_with_the_fraction_per_parameter(tmp_path):
    path, lin = _near_one_ckpt(tmp_path / "lin.pt")
    assert bool((lin.weight == 1.0).all())  # the real symptom: three Adam steps changed nothing
    result = inspect_checkpoints(path)
    f = next(f for f in result.findings if f.check == "lost_updates")
    assert f.severity == "warning"
    ev = f.evidence["params"]["model.weight"]
    # every weight is 1.0, whose bf16 half-ulp is 2**-8; Adam's update is at most ~lr = 1e-4
    assert ev["fraction"] == 1.0 and ev["dtype"] == "bfloat16"
    assert ev["typical_half_ulp"] == pytest.approx(2 ** -8)
    assert "model.weight (bfloat16: 100% of updated elements" in f.message
    assert "FP32 master weights" in f.message


def test_bf16_weights_at_a_large_lr_do_not_lose_their_updates(tmp_path):
    path, lin = _near_one_ckpt(tmp_path / "lin.pt", lr=0.05)
    assert not bool((lin.weight == 1.0).all())
    assert "lost_updates" not in _checks(inspect_checkpoints(path))


def test_fp32_weights_at_the_same_small_lr_are_not_lost_updates(tmp_path):
    path, lin = _near_one_ckpt(tmp_path / "lin.pt", dtype=torch.float32)
    assert not bool((lin.weight == 1.0).all())
    assert "lost_updates" not in _checks(inspect_checkpoints(path))


def test_a_pair_runs_the_optimizer_checks_on_the_later_file(tmp_path):
    a, _ = _embedding_ckpt(tmp_path / "a.pt", eps=1e-4)
    b, _ = _embedding_ckpt(tmp_path / "b.pt")
    f = next(f for f in inspect_checkpoints(a, b).findings if f.check == "optimizer_eps_underflow")
    assert f.message.startswith("b.pt: ")
    assert "optimizer_eps_underflow" not in _checks(inspect_checkpoints(b, a))


def test_inspect_cli_prints_optimizer_eps_underflow(tmp_path):
    path, _ = _embedding_ckpt(tmp_path / "emb.pt")
    out = CliRunner().invoke(main, ["inspect", str(path)])
    assert "optimizer_eps_underflow" in out.output


_num = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 10**20), st.booleans(),
                 st.text(max_size=3), st.none())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lr=_num, eps=_num, b1=_num, b2=_num, step=st.one_of(_num, st.floats(-5, 1e6)),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
       scale=st.one_of(st.floats(-1e5, 1e5), st.sampled_from([math.nan, math.inf, -math.inf])))
def test_hostile_hyperparameters_and_state_never_crash_the_optimizer_checks(tmp_path, lr, eps, b1, b2, step, dtype,
                                                                            scale):
    lin = nn.Linear(3, 2).to(dtype)
    opt = torch.optim.Adam(lin.parameters())
    lin(torch.randn(4, 3, dtype=dtype)).float().sum().backward()
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0].update(lr=lr, eps=eps, betas=(b1, b2))
    for s in sd["state"].values():
        s["exp_avg"].mul_(scale)
        numeric = isinstance(step, (int, float)) and not isinstance(step, bool) and not (isinstance(step, int) and abs(step) >= 2**63)
        s["step"] = torch.tensor(step) if numeric else step  # an int past int64 stays a Python int: hostile too
    path = tmp_path / "h.pt"
    torch.save({"model": lin.state_dict(), "optimizer": sd}, path)
    try:
        result = inspect_checkpoints(path)
    except AnalyzerError:
        return
    for f in result.findings:
        assert f.check and isinstance(f.message, str)
        if f.check == "lost_updates":
            assert all(0 <= p["fraction"] <= 1 and math.isfinite(p["fraction"]) for p in f.evidence["params"].values())


def test_acceptance_inspect_of_the_fp16_adam_eps_runs_model_and_optimizer_gives_optimizer_eps_underflow(
        tmp_path, fp16_adam_eps_update_run):
    from analyzer.load import load_snapshot

    info = fp16_adam_eps_update_run  # tests/conftest.py: record_fp16_adam_eps(check_update=True)
    snap = load_snapshot(next(p for p in info["snapshots"] if p.stem.endswith("-update")))
    path = tmp_path / "ckpt.pt"  # the checkpoint a training script would save at that step
    torch.save({"model": snap.model_state, "optimizer": snap.optimizer["state_dict"]}, path)
    f = next(f for f in inspect_checkpoints(path).findings if f.check == "optimizer_eps_underflow")
    assert f.evidence["dtype"] == info["dtype"] and f.evidence["eps"] == info["eps"]


def test_inspect_of_an_update_snapshot_maps_its_optimizer_state_by_name_and_gives_optimizer_eps_underflow(
        fp16_adam_eps_update_run):
    info = fp16_adam_eps_update_run  # tests/conftest.py: record_fp16_adam_eps(check_update=True)
    result = inspect_checkpoints(next(p for p in info["snapshots"] if p.stem.endswith("-update")))
    opt = result.files[0].ckpt.optimizers[0]
    assert opt.mapping == "param_names"  # from the snapshot's param_names, not a guess by order
    assert "optimizer[model_state.emb.weight].exp_avg_sq" in [t.name for t in result.files[0].tensors]
    f = next(f for f in result.findings if f.check == "optimizer_eps_underflow")
    assert "model_state.emb.weight" in f.evidence["params"]

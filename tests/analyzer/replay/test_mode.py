"""The op recorder underneath replay: statistics, attribution, roots, alignment and the shadow check.

These drive the private dispatch mode and run helpers directly on real tiny models.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from analyzer.replay.runs._attribution import _ForwardTagMode, attach_module_hooks
from analyzer.replay.runs._mode import _OpStatsMode
from analyzer.replay.detection._origin import align, find_origin, op_roots
from analyzer.replay.runs._runs import ReplayContext, run_once
from analyzer.replay.detection._shadow import shadow

from . import replay_models as rm


def _ctx(factory, loss_fn, batch, **kwargs) -> ReplayContext:
    model = getattr(rm, factory)(**kwargs)
    return ReplayContext(path="<test>", factory=getattr(rm, factory), factory_ref=factory, factory_kwargs=kwargs,
                         loss_fn=getattr(rm, loss_fn), loss_ref=loss_fn, model_state=model.state_dict(),
                         batch=batch, rng={"cpu": torch.get_rng_state(), "cuda": None}, train_mode=True,
                         device=torch.device("cpu"), emulate_cuda=False)


def _attention_batch(mask=None):
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(2, 8, 8, generator=g), "y": torch.randn(2, 8, 1, generator=g)}
    if mask is not None:
        batch["mask"] = mask
    return batch


def test_an_in_place_op_is_measured_on_its_input_before_it_ran():
    x = torch.randn(16)
    mode = _OpStatsMode()
    with mode:
        x.masked_fill_(x > 0, float("inf"))
    absmax, _ = mode.finalize()
    rec = mode.records[-1]
    assert rec.name == "aten.masked_fill_" and rec.literal_nonfinite
    assert math.isfinite(absmax[rec.inputs[0][0]])  # the input, read before the op overwrote it
    assert absmax[rec.outputs[0]] == math.inf


def test_statistics_stay_tensors_until_finalize_syncs_them_once():
    mode = _OpStatsMode()
    with mode:
        (torch.ones(4) * 2).exp()
    assert mode._maxs and all(isinstance(m, torch.Tensor) for m in mode._maxs)
    absmax, nonzero = mode.finalize()
    assert all(isinstance(v, float) for v in absmax) and nonzero == []
    assert max(absmax) == torch.tensor(2.0).exp().item()  # exp(2) in FP32: the largest value of any op


def test_zero_counts_are_kept_only_when_asked_for():
    mode = _OpStatsMode(zeros=True)
    with mode:
        torch.tensor([0.0, 1.0, 0.0, 3.0]).relu()
    _, nonzero = mode.finalize()
    rec = mode.records[-1]
    (stat, numel), = rec.zeros
    assert numel - nonzero[stat] == 2  # relu keeps the two zeros


def test_sibling_projections_sharing_an_input_are_told_apart_in_backward():
    # ModuleTracker reports q/k/v together in backward; node tagging attributes each exactly.
    run = run_once(_ctx("build_attention", "attention_mse", _attention_batch(), d=8), "float32", 1.0)
    backward_mm = {r.module for r in run.records if r.phase == "backward" and r.name == "aten.mm"
                   and r.node == "MmBackward0"}
    assert {"attn.q_proj", "attn.k_proj", "attn.v_proj"} <= backward_mm


def test_forward_ops_carry_the_user_source_line_and_their_module():
    run = run_once(_ctx("build_attention", "attention_mse", _attention_batch(), d=8), "float32", 1.0)
    bmm = next(r for r in run.records if r.name == "aten.bmm" and r.phase == "forward")
    lines = Path(rm.__file__).read_text().splitlines()
    file, line = bmm.source.rsplit(":", 1)
    assert file.endswith("replay_models.py") and "q @ k.transpose" in lines[int(line) - 1]
    assert bmm.module == "attn"


def test_loss_fn_ops_and_the_loss_scale_get_their_own_labels():
    run = run_once(_ctx("build_mlp", "mse", {"x": torch.randn(4, 4), "y": torch.randn(4, 1)}), "float32", 8.0)
    modules = {r.module for r in run.records}
    assert "<loss_fn>" in modules and "<loss_scale>" in modules
    mse = next(r for r in run.records if r.name == "aten.mse_loss")
    assert mse.module == "<loss_fn>"


def test_a_partly_masked_attention_with_minus_inf_is_healthy_and_has_no_origin():
    mask = torch.tril(torch.ones(8, 8, dtype=torch.bool)).expand(2, 8, 8)  # causal: never a full row
    run = run_once(_ctx("build_attention", "attention_mse", _attention_batch(mask), d=8, scaled=True),
                   "float32", 1.0)
    roots = op_roots(run)
    masked = next(r for r in run.records if r.name == "aten.masked_fill")
    assert roots[masked.index].literal  # the -inf is written on purpose
    assert run.finite and find_origin(run) is None


def test_fp16_and_fp32_runs_align_op_by_op_despite_autocast_casts():
    ctx = _ctx("build_attention", "attention_mse", _attention_batch(), d=8)
    low, ref = run_once(ctx, "float16", 1.0), run_once(ctx, "float32", 1.0)
    assert len(low.records) > len(ref.records)  # the FP16 run has autocast's _to_copy casts
    mapping = align(low, ref)
    bmm = [r.index for r in low.records if r.name == "aten.bmm" and r.phase == "forward"]
    assert [ref.records[mapping[i]].name for i in bmm] == ["aten.bmm", "aten.bmm"]
    assert all(low.records[i].name == ref.records[j].name for i, j in mapping.items())


def test_the_shadow_of_an_overflowing_cast_redoes_it_without_the_cast():
    captured = ((torch.tensor([70000.0]),), {"dtype": torch.float16})
    sh = shadow("aten._to_copy", "default", captured, torch.float16)
    assert sh["float32"] == 70000.0 and sh["float64"] == 70000.0 and sh["error"] is None


def test_the_shadow_of_log_of_zero_is_infinite_in_fp64_too():
    sh = shadow("aten.log", "default", ((torch.tensor([0.0, 1.0], dtype=torch.float16),), {}), torch.float16)
    assert sh["float32"] == math.inf and sh["float64"] == math.inf


def test_module_hooks_are_removed_after_a_run():
    ctx = _ctx("build_mlp", "mse", {"x": torch.randn(4, 4), "y": torch.randn(4, 1)})
    run_once(ctx, "float32", 1.0)
    model = ctx.build_model()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_the_function_mode_upcasts_cuda_fp32_ops_only_under_cpu_autocast():
    stats = _OpStatsMode()
    mode = _ForwardTagMode(stats, emulate_cuda=True)
    x = torch.randn(4, 4)
    with mode:
        with torch.autocast("cpu", dtype=torch.float16):
            inside = torch.softmax(x.half(), -1)
        outside = torch.softmax(x.half(), -1)
    assert inside.dtype == torch.float32 and outside.dtype == torch.float16
    assert mode.emulated == 1


def test_attach_module_hooks_pushes_the_innermost_module_path():
    model = rm.build_norm()
    seen = []
    stack: list[str] = []
    handles = attach_module_hooks(model, stack)
    model.norm.register_forward_pre_hook(lambda *a: seen.append(list(stack)))  # runs after ours
    model(torch.randn(2, 4))
    for h in handles:
        h.remove()
    assert seen == [["<model>", "norm"]] and stack == []


def test_an_in_place_write_and_a_view_of_it_keep_their_producer_after_autograd_bumps_versions():
    # autograd bumps an in-place output's version, and gives a view its base's counter, only
    # after the dispatch hook returns: both must still point at the op that wrote the value
    mask = torch.tensor([True, False, True, False])
    mode = _OpStatsMode()
    with mode:
        bias = torch.zeros(4)
        bias[mask] = float("-inf")               # index_put_: an in-place mask fill
        (bias.unsqueeze(0) + torch.ones(1, 4)).logsumexp(-1)
    mode.finalize()
    names = [r.name for r in mode.records]
    put, view, add = names.index("aten.index_put_"), names.index("aten.unsqueeze"), names.index("aten.add")
    assert mode.records[view].inputs[0][1] == put
    assert mode.records[add].inputs[0][1] == view


def test_a_write_the_op_does_not_return_drops_the_recorded_producer():
    bn = torch.nn.BatchNorm1d(3)
    mode = _OpStatsMode()
    with mode:
        bn.running_mean.add_(1.0)                # recorded: running_mean now comes from add_
        before = bn.running_mean * 1.0
        bn(torch.randn(4, 3))                    # train mode: rewrites running_mean, does not return it
        after = bn.running_mean * 1.0
    mode.finalize()
    add = next(r.index for r in mode.records if r.name == "aten.add_")
    muls = [r for r in mode.records if r.name == "aten.mul"]
    assert muls[0].inputs[0][1] == add and muls[1].inputs[0][1] is None
    del before, after


def test_train_mode_batch_norm_running_stats_are_not_inputs_of_the_batch_norm_op():
    bn = torch.nn.BatchNorm1d(3)
    bn.running_mean.fill_(float("nan"))
    x = torch.randn(4, 3, requires_grad=True)
    mode = _OpStatsMode()
    with mode:
        bn(x).sum().backward()
    absmax, _ = mode.finalize()
    norms = [r for r in mode.records if "batch_norm" in r.name]
    assert {r.phase for r in norms} == {"forward", "backward"}
    # only the input, weight, bias (and gradient) are inputs: the NaN running mean is not among them
    assert all(math.isfinite(absmax[s]) for r in norms for s, _ in r.inputs)
    assert torch.isfinite(x.grad).all()

"""``analyzer report`` end to end on runs recorded by the real Recorder (tiny models, CPU)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main
from analyzer.report import build_report

from . import report_models as rm

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _checks(rep, *severities):
    return {f.check for f in rep.findings if f.severity in severities}


@pytest.fixture(scope="module")
def attn_run(tmp_path_factory):
    # attention logits not divided by sqrt(d) and Adam at lr=1.0: the logits pass 65504 by
    # step ~13 and every later step overflows; the scale halves each step (measured: below 1
    # by step ~30 and at 1e-7 by step 45)
    kw = dict(vocab=16, d=32, gain=1.0)
    return rm.train_recorded(tmp_path_factory.mktemp("attn") / "run", model=rm.build_attn(**kw),
                             factory="tests.analyzer.report_models:build_attn", factory_kwargs=kw,
                             loss_fn=rm.attn_loss, steps=50, amp_dtype=torch.float16, lr=1.0, kind="tokens")


def test_fp16_attention_overflow_gives_scale_collapse_and_names_the_snapshot(attn_run):
    rep = build_report(attn_run)
    assert "scale_collapse" in _checks(rep, "error") and "nonfinite_loss" in _checks(rep, "error")
    sc = next(f for f in rep.findings if f.check == "scale_collapse")
    assert sc.evidence["min_scale"] < 1 and not sc.evidence["recovered"]
    nf = next(f for f in rep.findings if f.check == "nonfinite_loss")
    assert rep.frames.snapshots and nf.evidence["snapshot"] == rep.frames.snapshots[0]["file"]
    assert "analyzer replay" in nf.message and rep.verdict.startswith("FAILED")


def test_deep_sigmoid_mlp_with_small_init_names_the_early_layers(tmp_path):
    kw = dict(depth=10, width=16, init_std=0.02)
    run = rm.train_recorded(tmp_path / "run", model=rm.build_sigmoid_mlp(**kw),
                            factory="tests.analyzer.report_models:build_sigmoid_mlp", factory_kwargs=kw,
                            loss_fn=rm.mlp_loss, steps=40, amp_dtype=torch.float16, lr=1e-3)
    rep = build_report(run)
    f = next(f for f in rep.findings if f.check == "stalled_layers")
    # sigmoid' <= 0.25 times weights of std 0.02 (x sqrt(16)): ~0.02 per layer, so the first
    # Linear layers get gradients that round to zero in FP16; the stalled ones are a prefix
    assert f.evidence["location"] == "early" and f.evidence["layers"][:2] == ["0.weight", "0.bias"]
    assert "vanishing_gradients" in _checks(rep, "warning")
    assert not _checks(rep, "error")


def test_loss_outside_autocast_gives_low_precision_loss(tmp_path):
    kw = dict(width=16)
    run = rm.train_recorded(tmp_path / "run", model=rm.build_small_mlp(**kw),
                            factory="tests.analyzer.report_models:build_small_mlp", factory_kwargs=kw,
                            loss_fn=rm.mlp_loss, steps=30, amp_dtype=torch.float16, lr=1e-3,
                            outside_autocast=True)
    rep = build_report(run)
    f = next(f for f in rep.findings if f.check == "low_precision_loss")
    assert f.evidence["loss_dtype"] == "float16" and f.evidence["steps"] == 30


def test_a_bias_before_batchnorm_is_reported_as_redundant_not_as_a_stall(tmp_path):
    kw = dict(width=16)
    run = rm.train_recorded(tmp_path / "run", model=rm.build_bn_mlp(**kw),
                            factory="tests.analyzer.report_models:build_bn_mlp", factory_kwargs=kw,
                            loss_fn=rm.mlp_loss, steps=60, amp_dtype=None, lr=3e-3)
    rep = build_report(run)
    assert not _checks(rep, "error", "warning"), [f.message for f in rep.findings]
    info = next(f for f in rep.findings if f.check == "stalled_layers")
    # BatchNorm removes the batch mean of its input, so the Linear biases feeding it (0.bias,
    # 3.bias) get gradients at rounding level while their weights learn
    assert info.severity == "info" and set(info.evidence["layers"]) == {"0.bias", "3.bias"}


@pytest.mark.parametrize("amp", [torch.float16, torch.bfloat16, None], ids=["fp16", "bf16", "fp32"])
def test_healthy_recorded_run_has_no_errors_or_warnings(tmp_path, amp):
    kw = dict(width=16)
    run = rm.train_recorded(tmp_path / "run", model=rm.build_small_mlp(**kw),
                            factory="tests.analyzer.report_models:build_small_mlp", factory_kwargs=kw,
                            loss_fn=rm.mlp_loss, steps=120, amp_dtype=amp, lr=3e-3)
    rep = build_report(run)
    assert not _checks(rep, "error", "warning"), [f.message for f in rep.findings]
    assert rep.verdict.startswith("healthy")


def test_cli_report_writes_plots_and_html_for_a_recorded_run(attn_run, tmp_path):
    res = CliRunner().invoke(main, ["report", str(attn_run), "--plots", str(tmp_path / "p"),
                                    "--html", str(tmp_path / "r.html")])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[1].startswith("Verdict: FAILED")
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == [
        "grad_heatmap.png", "grad_vs_depth.png", "loss_scale.png", "stalled_fraction.png"]
    page = (tmp_path / "r.html").read_text()
    assert "scale_collapse" in page and "snapshots/step" in page


# --------------------------------------------------------------------------- two ranks, gloo
def _ddp_worker(rank: int, world: int, init: str, run_dir: str, nan_step: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from recorders import Recorder

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = DDP(rm.build_small_mlp(16))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(100 + rank)
        with Recorder(run_dir, model, factory="tests.analyzer.report_models:build_small_mlp",
                      factory_kwargs={"width": 16}, loss_fn=rm.mlp_loss, amp_dtype=torch.bfloat16,
                      optimizer=opt, flush_every=5) as rec:
            for step in range(nan_step + 4):
                x = torch.randn(32, 16, generator=g)
                if rank == 1 and step == nan_step:
                    x[3, 5] = float("nan")  # one bad sample in rank 1's local batch
                batch = {"x": x, "y": torch.randint(0, 4, (32,), generator=g)}
                rec.begin_step(step, batch)
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = rm.mlp_loss(model, batch)
                loss.backward()  # DDP averages rank 1's NaN gradients into rank 0's
                rec.end_step(loss)
                opt.step()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_report_names_the_rank_and_step_of_the_first_nan(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    run = tmp_path / "ddp"
    init = f"file://{tmp_path / 'rendezvous'}"
    root = str(Path(__file__).resolve().parents[2])  # spawned workers import this test module by name
    monkeypatch.setenv("PYTHONPATH", root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    mp.spawn(_ddp_worker, args=(2, init, str(run), 6), nprocs=2, join=True)
    rep = build_report(run)
    f = next(f for f in rep.findings if f.check == "rank_divergence" and f.severity == "error")
    # rank 1's local loss is NaN at step 6; the averaged NaN gradient makes every weight NaN,
    # so rank 0's loss is NaN from step 7
    assert (f.step, f.rank) == (6, 1)
    assert f.evidence["first_nonfinite_step_per_rank"] == {0: 7, 1: 6}
    obj = json.loads(CliRunner().invoke(main, ["report", str(run), "--json", "--rank", "1"]).output)
    assert next(x for x in obj["findings"] if x["check"] == "nonfinite_loss")["step"] == 6

"""FP8 gradients beyond e4m3's range: losses that weigh some tokens 1e6 times the others, torchao's rowwise
recipe (every operand e4m3). The weight-gradient GEMM scales grad_output per output feature across the tokens:
the heavy tokens set every such scale and the other tokens' gradients fall below e4m3's smallest subnormal.

Where the heavy tokens also enter the weight-gradient sums (``swiglu_models.weighted_batch``), that costs the
step nothing BF16 can see: a flushed value is below 2**-10 / 448 (about 2e-6) of its column's largest, and BF16
rounds the sums it enters to 2**-9. The replay names the cast and gives no verdict. Where they do not (their
input to the Linear is 0: ``grad_models``), the Linear's weight gradient is the flushed tokens' alone, it is
lost, and ``fp8_underflow`` on grad_output is verified fixed by e5m2 gradients against BF16."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from analyzer.cli import main
from analyzer.load import load_snapshot
from tests.extras import require

from . import swiglu_models as sm

require("torchao.float8", "fp8")


@pytest.fixture(scope="module")
def weighted(tmp_path_factory):
    return sm.train_fp8(tmp_path_factory.mktemp("grads") / "run", aligned=False, recipe="rowwise", steps=1, heavy=1e6)


def test_heavy_tokens_flush_the_e4m3_grad_output_of_the_weight_gradient_and_the_step_still_agrees(weighted):
    res = CliRunner().invoke(main, ["replay", str(weighted), "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    fp8 = json.loads(res.stdout)["fp8"]
    first = fp8["first"]
    assert (first["module"], first["role"], first["use"], first["fmt"], first["granularity"]) == (
        "head", "grad_output", "weight gradient", "e4m3", "rowwise")
    assert first["breaks"] == "underflow" and first["flushed"] / first["nonzero"] > 0.5
    # every flushing cast is a grad_output of a weight gradient; the forward and input-gradient casts keep theirs
    assert {(c["role"], c["use"]) for c in fp8["breaking"]} == {("grad_output", "weight gradient")}
    assert fp8["agrees_with_bf16"] is True and fp8["verdict"] is None


def test_e5m2_gradients_keep_the_values_e4m3_flushed(weighted):
    from analyzer.replay import Replay
    from analyzer.replay.fp8.recipe import with_gradients_in
    from analyzer.replay.fp8.step import fp8_context, run_values

    replay = Replay(weighted, device="cpu")
    ev = replay.run().diagnosis.evidence["fp8"]
    ctx = replay.context()
    e5m2 = run_values(fp8_context(ctx, with_gradients_in(ctx.fp8_recipe, "float8_e5m2")), ev.precision, "e5m2", fp8=True)
    grads = [c for c in e5m2.casts if c.role == "grad_output"]
    assert grads and {c.fmt for c in grads} == {"e5m2"}
    assert max(c.stats.flushed_frac for c in grads) < 0.05  # e5m2's range, 3.8e9, covers the weights' 1e6


def test_the_e5m2_fix_applies_to_a_broken_e4m3_gradient_only(weighted, tmp_path):
    from analyzer.replay import FIXES, Replay

    replay = Replay(weighted, device="cpu")
    result = replay.run()
    fix = FIXES["fp8_e5m2_grads"].apply(replay.context(), result)
    assert fix.status == "verified" and "the unchanged FP8 step agrees too" in fix.detail
    aligned = Replay(sm.train_fp8(tmp_path / "aligned"), device="cpu")  # its broken cast is w2's input
    assert FIXES["fp8_e5m2_grads"].apply(aligned.context(), aligned.run()) is None


def test_a_rowwise_cast_of_a_32_wide_3d_input_keeps_its_own_rows_and_channels(weighted):
    # w1's input is (4, 16, 32) with a scale per token: the layout of an MX block view, yet rowwise, read by a
    # Float8TrainingTensor GEMM: its outlier is a channel of 32, not a position in a 512-wide row
    from analyzer.replay import Replay

    ev = Replay(weighted, device="cpu").run().diagnosis.evidence["fp8"]
    (w1,) = [c for c in ev.casts if (c.module, c.role, c.use) == ("block.mlp.w1", "input", "forward")]
    assert w1.granularity == "rowwise" and w1.shape == (4, 16, sm.DIM)
    assert 0 <= w1.outlier[1] < sm.DIM and 0 <= w1.outlier[0] < 4 * 16


@pytest.fixture(scope="module")
def heavy(tmp_path_factory):
    # grad_models: the heavy tokens' w2 input is 0, so w2's weight gradient is the light tokens' alone, and those
    # flush under the heavy tokens' per-feature e4m3 scales
    from . import grad_models as gm

    run = tmp_path_factory.mktemp("heavy") / "run"
    return run, gm.train(run)


def test_the_report_names_the_weight_gradients_grad_output_cast_without_advising_rowwise(heavy):
    run, _ = heavy
    res = CliRunner().invoke(main, ["report", str(run), "--json"])
    assert res.exit_code == 0, res.output
    found = [f for f in json.loads(res.stdout)["findings"] if f["check"] == "fp8_casts"]
    assert found and {(f["evidence"]["role"], f["evidence"]["use"]) for f in found} == {
        ("grad_output", "weight gradient")}  # the forward and input-gradient casts keep their values
    w2 = next(f["message"] for f in found if f["evidence"]["module"] == "block.mlp.w2")
    assert w2.startswith("block.mlp.w2 grad_output (weight gradient GEMM, e4m3 rowwise)")
    assert "rowwise scaling or" not in w2 and "e5m2 gradients cover a wider range" in w2  # it is rowwise already


def test_gradients_beyond_e4m3s_range_autopsy_to_fp8_underflow_and_e5m2_is_verified_against_bf16(heavy):
    run, snaps = heavy
    # the recorder's own trigger: it counts grad_output for the weight-gradient GEMM too, scaled per output feature
    assert [p.name for p in snaps] == ["step00000000-r00000-fp8.pt"]
    fired = load_snapshot(snaps[0]).fp8["fired"]
    assert (fired["role"], fired["use"], fired["format"], fired["granularity"]) == (
        "grad_output", "weight gradient", "e4m3", "rowwise")
    assert fired["flushed_frac"] > 0.5
    res = CliRunner().invoke(main, ["autopsy", str(run), "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    a = json.loads(res.stdout)
    assert a["verdict"] == "fp8_underflow"
    fp8 = a["replays"][0]["fp8"]
    first = fp8["first"]
    assert (first["role"], first["use"], first["phase"], first["fmt"]) == ("grad_output", "weight gradient",
                                                                         "backward", "e4m3")
    assert any(c["module"] == "block.mlp.w2" and c["role"] == "grad_output" for c in fp8["breaking"])
    assert fp8["grad_jump"]["name"] == "block.mlp.w2.weight" and fp8["grad_jump"]["cosine"] < 0.5
    assert fp8["bf16_agrees_with_fp32"] is True  # BF16 is a valid reference here
    fixes = {f["name"]: f for f in a["fixes"]}
    # e5m2 keeps the light tokens' gradients (its w3 gradient is ~0.18 off BF16: e5m2's 2 mantissa bits)
    assert fixes["fp8_e5m2_grads"]["status"] == "verified"
    assert "the unchanged FP8 step fails the same test" in fixes["fp8_e5m2_grads"]["detail"]
    assert fixes["fp8_rowwise"]["status"] == "fails"  # the step is already rowwise

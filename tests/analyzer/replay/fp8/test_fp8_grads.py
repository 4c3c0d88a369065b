"""FP8 gradients: a loss that weighs two tokens 1e6 times the others, trained with torchao's rowwise recipe
(every operand e4m3). The weight-gradient GEMM scales grad_output per output feature across the tokens: the two
heavy tokens set every such scale, and the other 62 tokens' gradients fall below e4m3's smallest subnormal.

What that costs the step: nothing BF16 can see. A flushed value is below 2**-10 / 448 (about 2e-6) of the
largest value of its column, which enters the same weight-gradient sums; BF16 rounds those sums to 2**-9. So
the replay names the flushing cast and gives no verdict; e5m2 (max / smallest subnormal: 57344 * 2**16, about
3.8e9, against e4m3's 448 * 2**9, about 2.3e5) keeps those values, and its fix is offered only through a verdict."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from analyzer.cli import main
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

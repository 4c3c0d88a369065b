"""The FP8 replay: a torchao tensorwise FP8 step replayed in FP32, BF16 and FP8, its verdicts and its fixes.

The runs are real: ``swiglu_models.train_fp8`` trains the tiny transformer with torchao's tensorwise FP8
(BF16 autocast) under the Recorder and snapshots its last step with reason ``fp8``.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from analyzer.cli import main
from tests.extras import require

from . import swiglu_models as sm

require("torchao.float8", "fp8")


def _json(*args) -> dict:
    res = CliRunner().invoke(main, [*args, "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    return sm.train_fp8(tmp_path_factory.mktemp("fp8") / "aligned")


@pytest.fixture(scope="module")
def aligned_replay(aligned):
    return _json("replay", str(aligned))


@pytest.fixture(scope="module")
def aligned_autopsy(aligned):
    return _json("autopsy", str(aligned.parent.parent))


def test_replay_names_fp8_underflow_at_w2s_forward_input_with_the_flushed_fraction_and_the_outlier_channel(aligned_replay):
    r = aligned_replay
    assert r["verdict"] == "fp8_underflow"
    first = r["fp8"]["first"]
    assert (first["module"], first["role"], first["use"], first["phase"]) == ("block.mlp.w2", "input", "forward", "forward")
    assert (first["fmt"], first["granularity"], first["breaks"]) == ("e4m3", "tensorwise", "underflow")
    # the outlier (2e4, the aligned channel on the rare token) sets the one scale: everything below ~0.04 flushes
    assert first["flushed_frac"] > 0.9 and first["amax"] > 1e4
    assert first["outlier"]["column"] == sm.OUTLIER  # the channel whose amax set the scale
    assert first["channel_gap"] > 1e3  # the aligned channel alone: 2e4 against at most ~1 in any other channel
    assert "flushed 97.9% of its" in r["summary"] or f"{first['flushed_frac']:.1%}" in r["summary"]
    assert f"channel {sm.OUTLIER}" in r["summary"]
    # the same input re-cast in backward for w2's weight gradient: attributed to w2 and its pass
    again = [c for c in r["fp8"]["breaking"] if c["phase"] == "backward"]
    assert [(c["module"], c["role"], c["use"]) for c in again] == [("block.mlp.w2", "input", "weight gradient")]


def test_the_answer_names_w2_as_the_layer_whose_output_leaves_bf16_with_the_numbers(aligned_replay):
    fp8 = aligned_replay["fp8"]
    assert fp8["jump"]["layer"] == "block.mlp.w2" and fp8["jump"]["rel_err"] > 0.5
    assert fp8["jump"]["previous"]["rel_err"] < fp8["thresholds"]["output_rel_err"]
    # BF16 itself agrees with FP32, FP8 does not agree with BF16: the test the fixes must pass
    assert fp8["bf16_agrees_with_fp32"] is True and fp8["agrees_with_bf16"] is False
    assert {g["name"] for g in fp8["gradients"]} >= {"block.mlp.w2.weight", "head.weight"}


def test_autopsy_verifies_rowwise_and_keep_in_bf16_against_bf16_where_the_unchanged_step_fails(aligned_autopsy):
    a = aligned_autopsy
    assert a["verdict"] == "fp8_underflow"
    fixes = {f["name"]: f for f in a["fixes"]}
    assert fixes["fp8_rowwise"]["status"] == "verified"
    assert fixes["fp8_keep_bf16"]["status"] == "verified"
    assert "fqn not in {'block.mlp.w2'}" in fixes["fp8_keep_bf16"]["title"]  # the printed module_filter_fn
    assert fixes["fp8_smooth_swiglu"]["status"] == "verified"  # the aligned-channel pattern is seen: tried
    for name in ("fp8_rowwise", "fp8_keep_bf16", "fp8_smooth_swiglu"):
        assert "the unchanged FP8 step fails the same test" in fixes[name]["detail"]
    assert a["replays"][0]["fp8"]["agrees_with_bf16"] is False
    # MXFP8 runs under BF16 autocast with its GEMMs' operands in BF16 (torchao's emulated mx_mm refuses mixed
    # dtypes): a scale per block of 32 gives the rare token's rows their own scales, as rowwise does
    mx = fixes["fp8_mxfp8"]
    assert mx["status"] == "verified" and "in bfloat16" in mx["title"]
    assert "the unchanged FP8 step fails the same test" in mx["detail"]


def test_the_printed_filter_keeps_exactly_w2_in_bf16(aligned_autopsy):
    title = {f["name"]: f for f in aligned_autopsy["fixes"]}["fp8_keep_bf16"]["title"]
    fn = eval(title[title.index("lambda"):title.rindex(")")])  # the tool's own generated source
    assert not fn(None, "block.mlp.w2") and fn(None, "block.mlp.w1") and fn(None, "head")


def test_an_all_zero_w2_input_at_one_step_gets_no_fp8_verdict(tmp_path):
    r = _json("replay", str(sm.train_fp8(tmp_path / "zero", gate_at=1)))
    assert r["verdict"] == "healthy"
    fp8 = r["fp8"]
    assert fp8["verdict"] is None and fp8["breaking"] == []
    # the cast ran on an all-zero tensor: nothing to flush (torchao floors its amax at 1e-12)
    assert fp8["casts"] > 0 and fp8["agrees_with_bf16"] is True


def test_a_healthy_fp8_run_has_no_fp8_finding(tmp_path):
    r = _json("replay", str(sm.train_fp8(tmp_path / "plain", aligned=False)))
    assert r["verdict"] == "healthy"
    assert r["fp8"]["verdict"] is None and r["fp8"]["breaking"] == [] and r["fp8"]["agrees_with_bf16"] is True
    assert "In FP8" not in r["summary"]


def test_a_factory_that_returns_the_converted_model_replays_fp32_on_its_plain_twin(tmp_path, aligned_replay):
    snap = sm.train_fp8(tmp_path / "factory", factory="build_fp8", write_recipe=False)
    r = _json("replay", str(snap))
    assert r["verdict"] == "fp8_underflow" and r["fp8"]["first"]["module"] == "block.mlp.w2"
    # the same op count as the replay of the plain factory: no FP8 cast in the FP32 and BF16 runs
    assert r["runs"]["float32"]["ops"] == aligned_replay["runs"]["float32"]["ops"]
    assert r["runs"]["bfloat16"]["ops"] == aligned_replay["runs"]["bfloat16"]["ops"]


def test_without_torchao_an_fp8_snapshot_gets_one_error_line_naming_the_extra(aligned):
    code = ("import sys; sys.modules['torchao'] = None; from analyzer.cli import main; "
            "sys.exit(main(['replay', sys.argv[1], '--device', 'cpu']))")
    res = subprocess.run([sys.executable, "-c", code, str(aligned)], capture_output=True, text=True, timeout=600)
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() + res.stdout.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "[fp8]" in errors[0] and str(aligned) in errors[0]
    assert "Traceback" not in res.stderr



def test_without_torchao_a_snapshot_without_an_fp8_recipe_replays_as_before(aligned, tmp_path):
    import torch

    data = torch.load(aligned, weights_only=True)
    del data["fp8_recipe"]  # the same step, recorded as a plain BF16 run
    plain = tmp_path / aligned.name
    torch.save(data, plain)
    code = ("import sys; sys.modules['torchao'] = None; from analyzer.cli import main; "
            "sys.exit(main(['replay', sys.argv[1], '--device', 'cpu', '--json']))")
    res = subprocess.run([sys.executable, "-c", code, str(plain)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["verdict"] == "healthy" and "fp8" not in out


def test_a_snapshot_whose_fp8_recipe_no_recorder_writes_gets_one_error_line_and_stays_unchanged(aligned, tmp_path):
    import torch

    data = torch.load(aligned, weights_only=True)
    data["fp8_recipe"] = {"configs": [{"kind": "float8", "fields": {}}], "modules": {"block.mlp.w2": 7}}
    bad = tmp_path / aligned.name
    torch.save(data, bad)
    before = bad.read_bytes()
    res = CliRunner().invoke(main, ["replay", str(bad), "--device", "cpu"])
    assert res.exit_code != 0
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "'fp8_recipe'" in errors[0] and str(bad) in errors[0]
    assert "Traceback" not in res.output and bad.read_bytes() == before


@pytest.mark.parametrize("loop", [{"amp": False}, {"micro": 2}], ids=["fp32_master_no_autocast", "two_micro_batches"])
def test_loops_without_autocast_or_with_accumulation_name_the_same_cast(tmp_path, loop):
    r = _json("replay", str(sm.train_fp8(tmp_path / "run", **loop)))
    assert r["verdict"] == "fp8_underflow"
    first = r["fp8"]["first"]
    assert (first["module"], first["role"], first["use"], first["outlier"]["column"]) == (
        "block.mlp.w2", "input", "forward", sm.OUTLIER)
    assert r["fp8"]["precision"] == ("float32" if loop.get("amp") is False else "bfloat16")
    # two micro-batches: each one's six casts per Linear, both replayed as training ran them
    assert r["fp8"]["casts"] == 36 * loop.get("micro", 1)

"""Attention backends: the snapshot's ``sdpa`` switches, the backend replay names, ``kernel_specific``.

Every run here is real: ``sdpa_models.record_run`` trains a tiny SDPA model with the Recorder in
FP16 autocast and the batch of step 3 makes its attention logits ~1.2e6. The math backend in
reduced precision overflows them (inf, then NaN in softmax); the CPU flash kernel keeps them in
FP32. 1.2e6 is 18x FP16's max, so no SIMD width changes the outcome (tested under
``ATEN_CPU_CAPABILITY=default`` as well).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from analyzer.cli import main
from analyzer.errors import BadInputError
from analyzer.load import load_snapshot
from analyzer.replay import replay_snapshot
from analyzer.replay.detection.backends import call_of, fused_backend
from recorders import schema
from recorders._sdpa import sdpa_state

from . import sdpa_models as sm

REPO = Path(__file__).resolve().parents[3]
_ALL_ON = {"flash": True, "mem_efficient": True, "math": True, "cudnn": True}


def _switches() -> tuple:
    cuda = torch.backends.cuda
    return (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
            cuda.cudnn_sdp_enabled(), cuda.fp16_bf16_reduction_math_sdp_allowed())


def _snapshots(run: Path) -> list[Path]:
    return sorted((run / schema.SNAPSHOT_DIR).iterdir())


@pytest.fixture(scope="module")
def math_run(tmp_path_factory) -> Path:
    """Trained on the math backend in reduced precision: step 3 goes NaN and is snapshotted."""
    return sm.record_run(tmp_path_factory.mktemp("math"), backend="math", reduced=True)


@pytest.fixture(scope="module")
def math_replay(math_run):
    before = _switches()
    result = replay_snapshot(_snapshots(math_run)[0], device="cpu")
    assert _switches() == before  # replay restores the caller's switches
    return result


def test_the_snapshot_records_the_switches_training_had(math_run):
    (snap,) = _snapshots(math_run)
    # sdpa_kernel([MATH]) turns the three others off; reduced precision was switched on by hand
    assert load_snapshot(snap).sdpa == {
        "enabled": {"flash": False, "mem_efficient": False, "math": True, "cudnn": False},
        "math_reduced_precision": True}
    assert load_snapshot(snap).format_version == schema.FORMAT_VERSION


def test_sdpa_state_reads_the_switches_sdpa_kernel_sets():
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        state = sdpa_state()
    assert state["enabled"] == {"flash": True, "mem_efficient": False, "math": True, "cudnn": False}
    assert state["math_reduced_precision"] is torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()


def test_a_math_overflow_that_flash_avoids_is_kernel_specific(math_replay):
    r = math_replay
    assert r.verdict == "kernel_specific"
    assert r.sdpa_backend == "math"
    # CPU offers math and the fused flash kernel; the other two are CUDA kernels
    assert r.backends == {"flash": "finite", "mem_efficient": "unavailable: CUDA only",
                          "cudnn": "unavailable: CUDA only"}
    assert (r.culprit["op"], r.culprit["module"], r.culprit["precision"]) == ("aten.bmm", "attn", "float16")
    assert r.culprit["output_kind"] == "inf" and r.runs["float32"]["finite"]
    assert "math backend" in r.summary and "finite on the flash backend" in r.summary
    assert r.advice[0].startswith("Run attention on the flash backend")
    assert "`with torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION): ...`" in r.advice[0]
    assert any("allow_fp16_bf16_reduction_math_sdp(True)" in a for a in r.advice)


def test_the_json_carries_the_backend_and_what_each_other_backend_did(math_replay):
    obj = json.loads(json.dumps(math_replay.to_dict(), allow_nan=False))
    assert obj["verdict"] == "kernel_specific"
    assert obj["sdpa_backend"] == "math" and obj["backends"]["flash"] == "finite"


def test_the_sdpa_call_owns_its_forward_decomposition_and_backward_nodes(math_replay):
    trace = math_replay.traces["float16"]
    (call,) = trace.sdpa_calls
    assert call.backend == "math" and call.module == "attn"
    inside = trace.records[call.start:call.end]
    assert {"aten.bmm", "aten._safe_softmax"} <= {r.name for r in inside}
    assert all(call_of(trace.sdpa_calls, r) is call for r in inside)
    backward = [r for r in trace.records if r.phase == "backward"]
    # the decomposition's bmm backward belongs to the call; the head's and projection's do not
    assert any(call_of(trace.sdpa_calls, r) is call and r.node == "BmmBackward0" for r in backward)
    outside = [r for r in backward if r.module == "head" or r.node == "AddmmBackward0"]
    assert outside and all(call_of(trace.sdpa_calls, r) is None for r in outside)


@pytest.mark.parametrize("backend, reduced, ran, verdict", [
    # all switches on: CPU picks its fused flash kernel, logits in FP32; no overflow, but on these large logits
    # its FP16 gradient is ~50 eps of FP16 (5%) from FP32's, and no forward op carries that error
    (None, True, "flash", "precision_error"),
    ("math", False, "math", "healthy"),  # math without reduced precision upcasts FP16 to FP32 (the default)
])
def test_a_step_on_a_backend_that_keeps_fp32_logits_replays_finite_and_names_it(tmp_path, backend, reduced, ran,
                                                                                 verdict):
    run = sm.record_run(tmp_path, backend=backend, reduced=reduced, manual=True)
    (snap,) = _snapshots(run)
    r = replay_snapshot(snap, device="cpu")
    assert all(x["finite"] for x in r.runs.values())
    assert r.verdict == verdict and r.sdpa_backend == ran and r.backends is None
    if verdict == "precision_error":
        assert r.culprit is None and "born in backward" in r.summary


def test_a_hand_written_attention_overflow_keeps_the_overflow_verdict(tmp_path):
    run = sm.record_run(tmp_path, backend="math", reduced=True, matmul=True)
    (snap,) = _snapshots(run)
    r = replay_snapshot(snap, device="cpu")
    # q @ kᵀ = 8 * 640^2 = 3.3e6 in FP16 before the division: a plain overflow, no attention kernel involved
    assert (r.verdict, r.culprit["op"], r.culprit["module"]) == ("overflow", "aten.bmm", "attn")
    assert r.sdpa_backend is None and r.backends is None


def test_a_version_2_snapshot_without_sdpa_loads_and_replays_under_the_process_switches(math_run, tmp_path):
    raw = torch.load(_snapshots(math_run)[0], weights_only=True)
    raw["format_version"] = 2
    del raw["sdpa"]
    path = tmp_path / "v2.pt"
    torch.save(raw, path)
    snap = load_snapshot(path)
    assert snap.sdpa is None and "sdpa" not in snap and snap.format_version == 2
    assert _switches()[0]  # this process has flash on (the default)
    r = replay_snapshot(path, device="cpu")
    # without the recorded switches, replay runs what this process allows: the flash kernel, finite, so the
    # failure recorded under the math kernel is not reproduced (never called healthy)
    assert r.verdict == "not_reproduced" and r.sdpa_backend == "flash"


@pytest.mark.parametrize("op, backend", [
    ("aten._scaled_dot_product_flash_attention_for_cpu", "flash"),
    ("aten._scaled_dot_product_flash_attention_for_cpu_backward", "flash"),
    ("aten._scaled_dot_product_flash_attention", "flash"),
    ("aten._scaled_dot_product_efficient_attention_backward", "mem_efficient"),
    ("aten._scaled_dot_product_cudnn_attention", "cudnn"),
    ("aten._efficient_attention_forward", "mem_efficient"),
    ("aten.bmm", None),
    ("aten._safe_softmax", None),
])
def test_fused_kernel_ops_are_named_by_their_backend(op, backend):
    assert fused_backend(op) == backend


_GOOD = {"enabled": dict(_ALL_ON), "math_reduced_precision": None}
_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.floats(allow_nan=True),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["enabled", "math_reduced_precision", *schema.SDPA_BACKENDS, "x"]), inner, max_size=5),
    max_leaves=12)


def _valid(v) -> bool:
    if v is None:
        return True
    return (isinstance(v, dict) and isinstance(v.get("enabled"), dict)
            and set(v["enabled"]) == set(schema.SDPA_BACKENDS)
            and all(isinstance(b, bool) for b in v["enabled"].values())
            and isinstance(v.get("math_reduced_precision"), (bool, type(None))))


@pytest.fixture(scope="module")
def raw_snapshot(math_run) -> dict:
    return torch.load(_snapshots(math_run)[0], weights_only=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_values | st.just(_GOOD) | st.builds(
    lambda b, r: {"enabled": {**_ALL_ON, "flash": b}, "math_reduced_precision": r},
    st.booleans() | st.integers(0, 1) | st.none(), st.booleans() | st.none() | st.text(max_size=2)))
def test_any_sdpa_value_loads_as_written_or_is_one_bad_input_error(raw_snapshot, value):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "s.pt")
        torch.save({**raw_snapshot, "sdpa": value}, path)
        if _valid(value):
            assert load_snapshot(path).sdpa == value
        else:
            with pytest.raises(BadInputError, match="sdpa"):
                load_snapshot(path)


def test_the_cli_refuses_a_hostile_sdpa_value_with_one_error_line(raw_snapshot, tmp_path):
    path = tmp_path / "hostile.pt"
    torch.save({**raw_snapshot, "sdpa": {"enabled": {"flash": "yes"}}}, path)
    before = path.read_bytes()
    result = CliRunner().invoke(main, ["replay", str(path)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0].startswith("Error: ") and "sdpa" in lines[0] and str(path) in lines[0]
    assert path.read_bytes() == before  # the input is never rewritten


def test_the_verdict_is_the_same_on_the_portable_cpu_kernels(tmp_path):
    """The same record-and-replay under ATEN_CPU_CAPABILITY=default (no SIMD): same verdict."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "tests.analyzer.replay.sdpa_models", str(tmp_path / "run")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    obj = json.loads(out.stdout.strip().splitlines()[-1])
    assert obj["capability"] == "DEFAULT"
    assert (obj["verdict"], obj["sdpa_backend"], obj["backends"]["flash"]) == ("kernel_specific", "math", "finite")
    assert (obj["culprit"]["op"], obj["culprit"]["module"]) == ("aten.bmm", "attn")


def test_a_cuda_only_recorded_backend_replays_on_cpu_under_the_process_switches(raw_snapshot, tmp_path):
    path = tmp_path / "mem_efficient_only.pt"
    only = {"flash": False, "mem_efficient": True, "math": False, "cudnn": False}
    torch.save({**raw_snapshot, "sdpa": {"enabled": only, "math_reduced_precision": True}}, path)
    r = replay_snapshot(path, device="cpu")  # CPU has no memory-efficient kernel: no "No viable backend"
    assert r.verdict == "not_reproduced" and r.sdpa_backend == "flash"  # the recorded math-kernel failure


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_math_overflow_is_kernel_specific_against_the_cuda_kernels(math_run):
    r = replay_snapshot(_snapshots(math_run)[0], device="cuda")
    assert r.verdict == "kernel_specific" and r.sdpa_backend == "math"
    assert set(r.backends) == {"flash", "mem_efficient", "cudnn"}
    assert "unavailable: CUDA only" not in r.backends.values()
    # the fused CUDA kernels keep the logits in FP32; at least one takes head_dim 8 in FP16
    assert any(v == "finite" for v in r.backends.values()), r.backends

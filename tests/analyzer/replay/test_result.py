"""``ReplayResult``: the JSON schema (strict, stable names), the text rendering and the plot."""
from __future__ import annotations

import json
import math

import pytest
import torch

from analyzer.render import plot_replay, render_replay_text
from analyzer.replay import VERDICTS, Diagnosis, ReplayResult, replay_snapshot
from analyzer.findings import json_safe

from . import replay_models as rm

TOP_KEYS = {"verdict", "summary", "culprit", "runs", "advice", "snapshot", "step", "reason", "device",
            "recorded_device", "device_note", "amp_dtype", "scale", "recorded_loss", "nonfinite_inputs",
            "written_only_buffers", "mask_inputs",
            "hidden_nonfinite", "literal_nonfinite", "underflow_at", "context_ops", "format", "format_version",
            "precision_mode", "precision_dtype", "precision_note"}
TOP_KEYS |= {"sdpa_backend", "backends"}  # the attention backend that ran, and the others tried
TOP_KEYS |= {"update"}  # the update forensics (analyzer.replay.update.forensics); None for a forward/backward replay
TOP_KEYS |= {"exception"}  # an exception snapshot's exception (type, message, frames, step); None otherwise
TOP_KEYS |= {"checkpoint"}  # a replay of a checkpoint and a batch: the files read and the defaults; None otherwise
TOP_KEYS |= {"micro_batches"}  # a step that accumulated gradients: how its micro-batches were combined; None otherwise
TOP_KEYS |= {"compiled"}  # a compiled model's snapshot: the step compiled as training compiled it; None otherwise
CULPRIT_KEYS = {"op", "overload", "module", "phase", "precision", "index", "source", "node", "input_dtypes",
                "output_dtype", "input_absmax", "output_absmax", "output_kind", "custom", "shadow"}
RUN_KEYS = {"finite", "loss", "loss_dtype", "forward_finite", "backward_finite", "grad_absmax", "scale", "ops",
            "first_nonfinite"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Three real recorded steps: an FP16 overflow, a loss-scale overflow and a healthy step."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)
    out = {}
    out["overflow"] = replay_snapshot(rm.record_step(
        tmp_path_factory.mktemp("o"), factory="build_attention", loss_fn="attention_mse",
        factory_kwargs={"d": 8, "gain": 8.0}, amp_dtype=torch.float16,
        batch={"x": torch.randn(2, 8, 8, generator=g) * 10, "y": torch.randn(2, 8, 1, generator=g)}))
    out["loss_scale_overflow"] = replay_snapshot(rm.record_step(
        tmp_path_factory.mktemp("s"), factory="build_mlp", loss_fn="sum_mse", batch={"x": x, "y": y + 3},
        amp_dtype=torch.float16, init_scale=65536.0, manual=True))
    out["healthy"] = replay_snapshot(rm.record_step(
        tmp_path_factory.mktemp("h"), factory="build_mlp", loss_fn="mse", batch={"x": x, "y": y},
        amp_dtype=torch.float16, manual=True))
    return out


@pytest.mark.parametrize("verdict", ["overflow", "loss_scale_overflow", "healthy"])
def test_to_dict_is_strict_json_with_the_documented_keys(results, verdict):
    obj = results[verdict].to_dict()
    text = json.dumps(obj, allow_nan=False)  # raises on a NaN/Infinity literal
    assert json.loads(text) == obj
    # a finite step carries its comparison with FP32 (fp32_comparison): the healthy one here
    assert set(obj) == TOP_KEYS | ({"fp32_comparison"} if verdict == "healthy" else set())
    assert obj["verdict"] == verdict and obj["verdict"] in VERDICTS
    assert isinstance(obj["advice"], list) and obj["advice"] and all(isinstance(a, str) for a in obj["advice"])
    for run in obj["runs"].values():
        assert RUN_KEYS <= set(run)


@pytest.mark.parametrize("verdict", ["overflow", "loss_scale_overflow"])
def test_a_failing_verdict_has_a_culprit_with_every_documented_field(results, verdict):
    culprit = results[verdict].to_dict()["culprit"]
    assert CULPRIT_KEYS <= set(culprit)
    assert culprit["phase"] in ("forward", "backward")
    assert isinstance(culprit["index"], int) and culprit["output_absmax"] in ("inf", "nan")


def test_a_healthy_result_has_a_null_culprit_and_no_first_nonfinite(results):
    obj = results["healthy"].to_dict()
    assert obj["culprit"] is None
    assert all(run["first_nonfinite"] is None for run in obj["runs"].values())


def test_the_overflow_culprit_carries_finite_fp32_and_fp64_shadow_values(results):
    shadow = results["overflow"].to_dict()["culprit"]["shadow"]
    assert shadow["float32"] > shadow["dtype_max"] == 65504.0
    assert shadow["float64"] == pytest.approx(shadow["float32"], rel=1e-3)


@pytest.mark.parametrize("value, expected", [
    (float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf"), (1.5, 1.5), (None, None),
])
def test_json_safe_maps_non_finite_floats_to_strings(value, expected):
    assert json_safe({"v": [value, (value,)]}) == {"v": [expected, [expected]]}


def test_an_unknown_verdict_is_refused():
    with pytest.raises(ValueError, match="verdict must be one of"):
        ReplayResult(Diagnosis("on_fire"), summary="", runs={}, snapshot="s", step=None,
                     reason=None, device="cpu", recorded_device="cpu", device_note=None, amp_dtype=None)


def test_the_text_shows_the_ops_around_the_culprit_with_the_culprit_marked(results):
    text = render_replay_text(results["overflow"], ops=4)
    table = text.split("ops around the culprit (float16):\n")[1].split("\n\n")[0].splitlines()
    assert len(table) == 1 + 5  # header, 2 ops before, the culprit, 2 after
    marked = [row for row in table if row.lstrip().startswith(">>")]
    assert len(marked) == 1 and "aten.bmm" in marked[0] and "inf" in marked[0]


def test_ops_zero_leaves_the_table_out(results):
    assert "ops around the culprit" not in render_replay_text(results["overflow"], ops=0)


def test_the_text_of_a_healthy_step_says_so_and_has_no_culprit(results):
    text = render_replay_text(results["healthy"])
    assert text.startswith("verdict: healthy\n") and "culprit:" not in text


def test_the_replay_plot_is_written_as_a_png_of_real_size(results, tmp_path):
    out = plot_replay(results["overflow"], tmp_path / "p.png")
    data = (tmp_path / "p.png").read_bytes()
    assert out.endswith("p.png") and data[:4] == b"\x89PNG" and len(data) > 10_000


def test_the_loss_scale_run_reports_its_scale_and_the_retry_at_scale_1(results):
    run = results["loss_scale_overflow"].to_dict()["runs"]["float16"]
    assert run["scale"] == 65536.0 and run["finite_at_scale_1"] is True and run["backward_finite"] is False
    assert math.isfinite(run["loss"])


def test_the_culprit_and_context_ops_are_frozen_records_whose_json_is_their_set_fields(results):
    import dataclasses

    from analyzer.replay import Culprit, OpRecord

    res = results["overflow"]
    culprit, as_json = res.culprit, res.to_dict()["culprit"]
    assert isinstance(culprit, Culprit) and all(isinstance(op, OpRecord) for op in res.context_ops)
    with pytest.raises(dataclasses.FrozenInstanceError):
        culprit.op = "aten.add"  # built once by the diagnosis, never patched afterwards
    # The JSON object is the record's set fields, in order; fields that do not apply are left out.
    assert list(as_json) == list(culprit) and as_json["op"] == culprit.op and as_json["index"] == culprit.index
    assert "input" not in culprit and "zeros" not in culprit and culprit.get("input") is None
    assert [op["index"] for op in res.to_dict()["context_ops"]] == [op.index for op in res.context_ops]


def _tensors(obj, seen=None) -> list[str]:
    """Paths to every torch.Tensor reachable from `obj` through dataclass fields, mappings and sequences."""
    import dataclasses

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return ["<tensor>"]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple, set)):
        items = list(enumerate(obj))
    else:
        return []
    return [f"{k}.{p}" for k, v in items for p in _tensors(v, seen)]


def test_a_result_holds_no_tensor_the_culprits_captured_inputs_stay_with_the_replay(results):
    # the overflow's culprit was re-run with its inputs captured (the shadow, the sqrt(head_dim) probe)
    r = results["overflow"]
    assert r.verdict == "overflow" and r.culprit_trace is not None and r.diagnosis is not None
    assert _tensors(r) == []


# What a Diagnosis holds that --json has: read from the result's one Diagnosis, never a second field.
_FROM_THE_DIAGNOSIS = ("verdict", "culprit", "scale", "recorded_loss", "nonfinite_inputs", "written_only_buffers",
                       "mask_inputs", "hidden_nonfinite", "literal_nonfinite", "underflow_at", "context_ops",
                       "culprit_trace", "precision_mode", "precision_dtype", "sdpa_backend", "backends", "compiled")


def test_a_result_reads_what_its_diagnosis_holds_instead_of_a_copy(results):
    import dataclasses

    assert not {f.name for f in dataclasses.fields(ReplayResult)} & set(_FROM_THE_DIAGNOSIS)
    r = results["overflow"]
    d = r.diagnosis
    other = dataclasses.replace(r, diagnosis=dataclasses.replace(
        d, masks=("batch:m",), written_only=("buffer:bn.running_var",), context_ops=d.context_ops[:1],
        nonfinite_inputs=("param:fc.weight",), hidden=d.context_ops[0]))
    j = other.to_dict()
    assert j["mask_inputs"] == ["batch:m"] and j["written_only_buffers"] == ["buffer:bn.running_var"]
    assert j["nonfinite_inputs"] == ["param:fc.weight"] and len(j["context_ops"]) == 1
    assert j["hidden_nonfinite"]["index"] == d.context_ops[0].index and r.to_dict()["hidden_nonfinite"] is None
    assert (j["verdict"], j["scale"], j["precision_mode"]) == (d.verdict, d.scale, d.mode)

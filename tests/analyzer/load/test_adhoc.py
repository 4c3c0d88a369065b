"""``load.adhoc``: a checkpoint and a batch read into a Snapshot; damaged and hostile files give one Error line."""
from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from analyzer.cli import main
from analyzer.errors import BadInputError
from analyzer.load.adhoc import checkpoint_instead, load_checkpoint_snapshot, read_batch
from tests.extras import require

from ..replay import replay_models as rm

_FACTORY = ["--factory", f"{rm.REF}:build_mlp", "--loss-fn", f"{rm.REF}:mse"]


def _files(tmp_path):
    ck, batch = tmp_path / "model.pt", tmp_path / "batch.pt"
    torch.save(rm.build_mlp().state_dict(), ck)
    torch.save({"x": torch.ones(2, 4), "y": torch.zeros(2, 1)}, batch)
    return ck, batch


def _one_error_line(result) -> str:
    assert "Traceback" not in result.output
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


def test_a_training_checkpoint_dict_gives_its_state_dict_step_and_saved_scaler_scale(tmp_path):
    _, batch = _files(tmp_path)
    ck = tmp_path / "ckpt.pt"
    scaler = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
              "_growth_tracker": 3}
    torch.save({"model_state_dict": {f"_orig_mod.{k}": v for k, v in rm.build_mlp().state_dict().items()},
                "optimizer": {"state": {}, "param_groups": []}, "scaler": scaler, "step": 41}, ck)
    snap = load_checkpoint_snapshot(ck, batch, factory=f"{rm.REF}:build_mlp", loss_fn=f"{rm.REF}:mse")
    assert set(snap.model_state) == set(rm.build_mlp().state_dict())  # torch.compile's prefix dropped
    assert snap.step == 41 and snap.scale == 1024.0 and snap.amp_dtype == "float16"
    assert any("GradScaler state saved in the checkpoint" in n for n in snap.notes)
    assert snap.rng["cpu"].equal(torch.Generator().manual_seed(0).get_state())


def test_bf16_has_no_scale_and_an_explicit_scale_wins(tmp_path):
    ck, batch = _files(tmp_path)
    kw = {"factory": f"{rm.REF}:build_mlp", "loss_fn": f"{rm.REF}:mse"}
    assert load_checkpoint_snapshot(ck, batch, amp="bf16", **kw).scale is None
    assert load_checkpoint_snapshot(ck, batch, amp="bf16", scale=8.0, **kw).scale == 8.0
    with pytest.raises(BadInputError, match="--scale"):
        load_checkpoint_snapshot(ck, batch, scale=math.inf, **kw)


def test_a_safetensors_state_dict_is_read_without_torch_load(tmp_path):
    safetensors = require("safetensors.torch", "hf")
    _, batch = _files(tmp_path)
    ck = tmp_path / "model.safetensors"
    safetensors.save_file(rm.build_mlp().state_dict(), ck)
    snap = load_checkpoint_snapshot(ck, batch, factory=f"{rm.REF}:build_mlp", loss_fn=f"{rm.REF}:mse")
    assert all(torch.equal(snap.model_state[k], v) for k, v in rm.build_mlp().state_dict().items())


def test_micro_batches_are_joined_into_one_batch_with_accumulate_join_and_the_note_says_so(tmp_path):
    f = tmp_path / "mb.pt"
    parts = [{"x": torch.full((2, 4), float(i)), "y": torch.zeros(2, 1)} for i in range(3)]
    torch.save(parts, f)
    batch, notes, micro = read_batch(f, accumulate="join")
    assert batch["x"].shape == (6, 4) and batch["x"][4:].eq(2.0).all() and micro is None
    assert "3 micro-batches" in notes[0] and "concatenation" in notes[0]
    torch.save([{"x": torch.ones(2, 4)}, {"x": torch.ones(2, 5)}], f)
    with pytest.raises(BadInputError, match="cannot be joined"):
        read_batch(f, accumulate="join")


def test_a_list_of_micro_batches_is_kept_as_a_list_with_the_mean_normalisation_named(tmp_path):
    f = tmp_path / "mb.pt"
    torch.save([{"x": torch.full((2, 4), float(i)), "y": torch.zeros(2, 1)} for i in range(3)], f)
    batch, notes, micro = read_batch(f)
    assert isinstance(batch, list) and len(batch) == 3 and batch[2]["x"].eq(2.0).all()
    assert micro == {"count": 3, "combine": "mean", "divisor": 3.0, "source": "batch_file", "num_items_in_batch": None}
    assert "each loss divided by 3" in notes[0] and "--accumulate sum" in notes[0] and "--accumulate join" in notes[0]
    _, _, summed = read_batch(f, accumulate="sum")
    assert summed["combine"] == "sum" and summed["divisor"] == 1.0


def test_micro_batches_that_carry_hfs_num_items_in_batch_are_divided_by_the_model_itself(tmp_path):
    f = tmp_path / "mb.pt"
    ids = torch.zeros(2, 8, dtype=torch.long)
    torch.save([{"input_ids": ids, "labels": ids, "num_items_in_batch": torch.tensor(28)} for _ in range(4)], f)
    batch, notes, micro = read_batch(f, hf=True)
    assert micro["combine"] == "num_items_in_batch" and micro["divisor"] == 1.0 and micro["num_items_in_batch"] == 28
    assert "num_items_in_batch (28)" in notes[0]


@pytest.mark.parametrize("obj, why", [
    ([], "holds an empty list"),
    ([{"x": torch.ones(2, 4)}, torch.ones(2, 4)], "item 1 is a Tensor, not a micro-batch (the list mixes Tensor, dict)"),
    ([{"x": torch.ones(2, 4)}, 3], "item 1 is a int"),
    ([[{"x": torch.ones(2, 4)}, {"x": torch.ones(2, 4)}], [{"x": torch.ones(2, 4)}, {"x": torch.ones(2, 4)}]],
     "item 0 is itself a list of micro-batches (nested lists)"),
    ([{"x": torch.ones(2, 4)}, {"z": torch.ones(2, 4)}], "micro-batch 1 differs from micro-batch 0"),
    ([{"x": torch.ones(2, 4)}, {"x": torch.ones(2, 4, dtype=torch.float16)}], "micro-batch 1 differs"),
    ([{"x": torch.ones(2, 4)}, {"x": "text"}], "micro-batch 1 holds no tensor"),
])
def test_an_odd_list_of_micro_batches_is_one_error_line_naming_the_file(tmp_path, obj, why):
    ck, batch = _files(tmp_path)
    torch.save(obj, batch)
    line = _one_error_line(CliRunner().invoke(main, ["replay", str(ck), "--batch", str(batch), *_FACTORY]))
    assert why in line and str(batch) in line


def test_checkpoint_instead_tells_checkpoints_from_snapshots(tmp_path, fp16_attention_step):
    ck, _ = _files(tmp_path)
    assert "not an amp-autopsy snapshot" in str(checkpoint_instead(ck))
    assert checkpoint_instead(fp16_attention_step) is None
    lightning = tmp_path / "x.ckpt"
    lightning.write_bytes(b"anything")
    assert "Lightning checkpoint" in str(checkpoint_instead(lightning))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert checkpoint_instead(hf) is None  # no weights: not a checkpoint directory
    (hf / "model.safetensors").write_bytes(b"")
    assert "HF checkpoint directory" in str(checkpoint_instead(hf))


def test_a_snapshot_given_as_the_checkpoint_says_to_replay_it_without_batch(tmp_path, fp16_attention_step):
    _, batch = _files(tmp_path)
    line = _one_error_line(CliRunner().invoke(main, ["replay", str(fp16_attention_step), "--batch", str(batch)]))
    assert "recorder snapshot" in line and "without --batch" in line


def test_amp_without_batch_is_a_usage_error(tmp_path, fp16_attention_step):
    res = CliRunner().invoke(main, ["replay", str(fp16_attention_step), "--amp", "bf16"])
    assert res.exit_code == 2 and "--batch" in res.output


@pytest.mark.parametrize("config, why", [
    ({"architectures": ["X"], "model_type": "gpt2", "auto_map": {"AutoModel": "m.X"}}, "auto_map"),
    ({"model_type": "gpt2"}, "names no single model class"),
    ("[1, 2]", "not a JSON object"),
    ("{not json", "not valid JSON"),
])
def test_an_hf_directory_whose_config_names_no_importable_class_is_one_error_line(tmp_path, config, why):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    torch.save(rm.build_mlp().state_dict(), hf / "pytorch_model.bin")
    _, batch = _files(tmp_path)
    line = _one_error_line(CliRunner().invoke(main, ["replay", str(hf), "--batch", str(batch)]))
    assert why in line


# -- hypothesis: damaged checkpoints and batches ---------------------------------------------------
_fast = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_fast
@given(which=st.sampled_from(["checkpoint", "batch"]), cut=st.floats(0.0, 0.999),
       flips=st.lists(st.tuples(st.floats(0.0, 0.999), st.integers(0, 255)), max_size=4))
def test_a_truncated_or_corrupted_checkpoint_or_batch_gives_one_error_line(tmp_path_factory, which, cut, flips):
    d = tmp_path_factory.mktemp("damaged")
    ck, batch = _files(d)
    target = ck if which == "checkpoint" else batch
    data = bytearray(target.read_bytes())
    for where, value in flips:
        data[int(where * len(data))] = value
    target.write_bytes(bytes(data[: max(1, int(cut * len(data)))]))
    res = CliRunner().invoke(main, ["replay", str(ck), "--batch", str(batch), *_FACTORY])
    _one_error_line(res)


_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6)
                       | st.builds(torch.zeros, st.integers(0, 3)),
                       lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                       max_leaves=8)


@_fast
@given(ck_obj=_values, batch_obj=_values)
def test_any_weights_only_content_as_checkpoint_and_batch_replays_or_gives_one_error_line(
        tmp_path_factory, ck_obj, batch_obj):
    d = tmp_path_factory.mktemp("foreign")
    ck, batch = d / "ck.pt", d / "batch.pt"
    torch.save(ck_obj, ck)
    torch.save(batch_obj, batch)
    res = CliRunner().invoke(main, ["replay", str(ck), "--batch", str(batch), *_FACTORY])
    _one_error_line(res)  # no content here fits build_mlp's state_dict: always refused, never a traceback


_micro = st.integers(1, 3).map(lambda n: {"x": torch.randn(n, 4), "y": torch.zeros(n, 1)})
_item = st.one_of(_micro, _values, st.lists(_micro, min_size=1, max_size=2),
                  st.dictionaries(st.sampled_from(["x", "y", "z"]), st.builds(torch.ones, st.integers(1, 3)), max_size=2))


@_fast
@given(items=st.lists(_item, max_size=4))
@example(items=[{"x": torch.randn(2, 4), "y": torch.zeros(2, 1)}, {"x": torch.randn(3, 4), "y": torch.zeros(3, 1)}])
@example(items=[])
def test_any_list_as_the_batch_file_replays_or_gives_one_error_line(tmp_path_factory, items):
    """Lists of micro-batches, damaged ones (empty, mixed, nested, other keys) and plain values: a list of
    two or more well-formed micro-batches replays as accumulation; anything else replays as one batch or
    is one Error line, never a traceback."""
    d = tmp_path_factory.mktemp("lists")
    ck, batch = _files(d)
    torch.save(items, batch)
    res = CliRunner().invoke(main, ["replay", str(ck), "--batch", str(batch), *_FACTORY, "--json"])
    def micro(i) -> bool:  # what _micro draws: x (n, 4) and y (n, 1), the shapes mse(build_mlp) takes
        return (isinstance(i, dict) and set(i) == {"x", "y"} and all(isinstance(v, torch.Tensor) for v in i.values())
                and i["x"].shape[1:] == (4,) and i["y"].shape[1:] == (1,) and len(i["x"]) == len(i["y"]))

    well_formed = len(items) >= 2 and all(micro(i) for i in items)
    if well_formed:
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["micro_batches"]["count"] == len(items)
    elif res.exit_code != 0:
        _one_error_line(res)
    else:
        assert "Traceback" not in res.output and json.loads(res.output)["micro_batches"] is None


def test_an_hf_batch_that_is_one_tensor_is_its_input_ids_and_labels_and_a_list_is_refused(tmp_path):
    f = tmp_path / "ids.pt"
    torch.save(torch.zeros(2, 8, dtype=torch.long), f)
    batch, notes, _ = read_batch(f, hf=True)
    assert set(batch) == {"input_ids", "labels"} and "input_ids=batch, labels=batch" in notes[0]
    torch.save([torch.zeros(2, 8, dtype=torch.long)], f)
    with pytest.raises(BadInputError, match="dict of its inputs"):
        read_batch(f, hf=True)
    torch.save([(torch.zeros(2, 8, dtype=torch.long),)] * 2, f)
    with pytest.raises(BadInputError, match="micro-batches are dicts of its inputs"):
        read_batch(f, hf=True)


@_fast
@given(cut=st.floats(0.0, 0.999), flips=st.lists(st.tuples(st.floats(0.0, 0.999), st.integers(0, 255)), max_size=4))
def test_a_damaged_safetensors_checkpoint_replays_or_gives_one_error_line(tmp_path_factory, cut, flips):
    safetensors = require("safetensors.torch", "hf")
    d = tmp_path_factory.mktemp("st")
    _, batch = _files(d)
    ck = d / "model.safetensors"
    safetensors.save_file(rm.build_mlp().state_dict(), ck)
    data = bytearray(ck.read_bytes())
    for where, value in flips:
        data[int(where * len(data))] = value
    ck.write_bytes(bytes(data[: max(1, int(cut * len(data)))]))
    res = CliRunner().invoke(main, ["replay", str(ck), "--batch", str(batch), *_FACTORY])
    if res.exit_code != 0:  # flipped weight bytes are still weights (safetensors has no checksum): a replay
        _one_error_line(res)


def test_an_hf_shard_index_naming_a_path_outside_the_directory_is_refused(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    torch.save(rm.build_mlp().state_dict(), tmp_path / "outside.bin")
    (hf / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"0.weight": "../outside.bin"}}))
    _, batch = _files(tmp_path)
    line = _one_error_line(CliRunner().invoke(main, ["replay", str(hf), "--batch", str(batch)]))
    assert "not a file in the directory" in line


def test_autopsy_rank_with_batch_is_a_usage_error(tmp_path):
    ck, batch = _files(tmp_path)
    res = CliRunner().invoke(main, ["autopsy", str(ck), "--batch", str(batch), "--rank", "0", *_FACTORY])
    assert res.exit_code == 2 and "--rank" in res.output

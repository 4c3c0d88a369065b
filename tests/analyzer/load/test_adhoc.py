"""``load.adhoc``: a checkpoint and a batch read into a Snapshot; damaged and hostile files give one Error line."""
from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.cli import main
from analyzer.errors import BadInputError
from analyzer.load.adhoc import checkpoint_instead, load_checkpoint_snapshot, read_batch

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
    safetensors = pytest.importorskip("safetensors.torch")
    _, batch = _files(tmp_path)
    ck = tmp_path / "model.safetensors"
    safetensors.save_file(rm.build_mlp().state_dict(), ck)
    snap = load_checkpoint_snapshot(ck, batch, factory=f"{rm.REF}:build_mlp", loss_fn=f"{rm.REF}:mse")
    assert all(torch.equal(snap.model_state[k], v) for k, v in rm.build_mlp().state_dict().items())


def test_micro_batches_are_joined_into_one_batch_and_the_note_says_so(tmp_path):
    f = tmp_path / "mb.pt"
    parts = [{"x": torch.full((2, 4), float(i)), "y": torch.zeros(2, 1)} for i in range(3)]
    torch.save(parts, f)
    batch, notes = read_batch(f)
    assert batch["x"].shape == (6, 4) and batch["x"][4:].eq(2.0).all()
    assert "3 micro-batches" in notes[0]
    torch.save([{"x": torch.ones(2, 4)}, {"x": torch.ones(2, 5)}], f)
    with pytest.raises(BadInputError, match="cannot be joined"):
        read_batch(f)


def test_a_tuple_batch_of_tensors_is_one_batch_not_micro_batches(tmp_path):
    f = tmp_path / "b.pt"
    torch.save((torch.ones(2, 4), torch.zeros(2, 1)), f)
    batch, notes = read_batch(f)
    assert isinstance(batch, tuple) and batch[0].shape == (2, 4) and notes == []


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


def test_an_hf_batch_that_is_one_tensor_is_its_input_ids_and_labels_and_a_list_is_refused(tmp_path):
    f = tmp_path / "ids.pt"
    torch.save(torch.zeros(2, 8, dtype=torch.long), f)
    batch, notes = read_batch(f, hf=True)
    assert set(batch) == {"input_ids", "labels"} and "input_ids=batch, labels=batch" in notes[0]
    torch.save([torch.zeros(2, 8, dtype=torch.long)], f)
    with pytest.raises(BadInputError, match="dict of its inputs"):
        read_batch(f, hf=True)


@_fast
@given(cut=st.floats(0.0, 0.999), flips=st.lists(st.tuples(st.floats(0.0, 0.999), st.integers(0, 255)), max_size=4))
def test_a_damaged_safetensors_checkpoint_replays_or_gives_one_error_line(tmp_path_factory, cut, flips):
    safetensors = pytest.importorskip("safetensors.torch")
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

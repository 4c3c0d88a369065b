"""analyzer inspect: real checkpoints from tiny models trained a few real steps, with faults injected."""
from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from analyzer.cli import main
from analyzer.errors import BadInputError, VersionError
from analyzer.inspect import _diagnose, inspect_checkpoints
from analyzer.render import render_inspect_text
from recorders import schema
from recorders.snapshot import build_snapshot, write_snapshot
from tests.extras import require

from .inspect_values import expected as _expected


def _model() -> nn.Sequential:
    # Linear -> BatchNorm -> ReLU -> Linear: weights, BatchNorm buffers, and a head we can freeze.
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _save(path, model, opt, step, **extra):
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, **extra}, path)
    return path


def _trained(tmp_path, name="ckpt.pt", steps=2):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, steps)
    return _save(tmp_path / name, model, opt, steps), model, opt


def _checks(result) -> list[str]:
    return [f.check for f in result.findings]


def _tensor(result, name, file=0):
    return next(t for t in result.files[file].tensors if t.name == name)


# --- layouts ---------------------------------------------------------------------------------

def test_a_healthy_training_checkpoint_has_no_findings_and_names_adam_state_by_parameter(tmp_path):
    path, model, opt = _trained(tmp_path)
    result = inspect_checkpoints(path)
    assert _checks(result) == []
    fr = result.files[0]
    assert fr.ckpt.layout == "training_checkpoint" and fr.ckpt.step == 2
    (o,) = fr.ckpt.optimizers
    # model.parameters() order = state_dict order minus BatchNorm's buffers, and every shape agrees
    assert o.mapping == "order" and o.n_params == 6 and "a guess" in o.note
    w = model[0].weight.detach()
    t = _tensor(result, "model.0.weight")
    assert t.stats.abs_max == w.abs().max().item() and t.stats.min_nonzero == w.abs().min().item()
    state = opt.state[model[0].weight]["exp_avg_sq"]
    assert _tensor(result, "optimizer[model.0.weight].exp_avg_sq").stats.abs_max == state.max().item()
    roles = {t.name: t.role for t in fr.tensors}
    assert roles["model.1.running_var"] == "buffer" and roles["model.1.weight"] == "weight"
    assert fr.ckpt.non_floating == 1  # num_batches_tracked is int64


def test_an_optimizer_built_from_named_parameters_maps_names_exactly(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-2)
    _train(model, opt, 1)
    result = inspect_checkpoints(_save(tmp_path / "c.pt", model, opt, 1))
    (o,) = result.files[0].ckpt.optimizers
    assert o.mapping == "param_names"
    assert _tensor(result, "optimizer[model.3.bias].exp_avg").param == "model.3.bias"


def test_an_optimizer_over_a_subset_of_parameters_is_not_guessed_and_says_why(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model[0].parameters(), lr=1e-2)  # 2 of the 6 parameters
    _train(model, opt, 1)
    result = inspect_checkpoints(_save(tmp_path / "c.pt", model, opt, 1))
    (o,) = result.files[0].ckpt.optimizers
    assert o.mapping == "none" and "2 parameters" in o.note and "6 in 'model'" in o.note
    assert _tensor(result, "optimizer[0].exp_avg_sq").param == "0"


def test_a_lightning_style_checkpoint_is_found_by_shape_with_its_global_step(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 1)
    torch.save({"epoch": 0, "global_step": 5, "state_dict": model.state_dict(),
                "optimizer_states": [opt.state_dict()], "lr_schedulers": []}, tmp_path / "last.ckpt")
    fr = inspect_checkpoints(tmp_path / "last.ckpt").files[0]
    assert (fr.ckpt.step, fr.ckpt.step_key) == (5, "global_step")  # global_step wins over epoch
    (o,) = fr.ckpt.optimizers
    assert o.path == "optimizer_states.0" and o.mapping == "order"
    assert "optimizer_states.0[state_dict.0.weight].exp_avg_sq" in {t.name for t in fr.tensors}


def test_an_optimizer_saved_alone_keeps_integer_ids_and_says_there_is_no_model(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 1)
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")  # how HF Trainer saves it
    fr = inspect_checkpoints(tmp_path / "optimizer.pt").files[0]
    (o,) = fr.ckpt.optimizers
    assert o.mapping == "none" and "no model state_dict in the file" in o.note
    assert _tensor(inspect_checkpoints(tmp_path / "optimizer.pt"), "optimizer[0].exp_avg").param == "0"


def test_tied_weights_count_once_when_mapping_optimizer_ids_by_order(tmp_path):
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = head(emb(torch.tensor([1, 2]))).sum()
    loss.backward()
    opt.step()
    result = inspect_checkpoints(_save(tmp_path / "c.pt", model, opt, 1))
    (o,) = result.files[0].ckpt.optimizers
    # the state_dict holds emb.weight and head.weight (one storage); parameters() yields it once
    assert o.mapping == "order" and o.n_params == 1
    assert [t.name for t in result.files[0].tensors if t.role == "optimizer"] == [
        "optimizer[model.emb.weight].momentum_buffer"]


def test_a_plain_state_dict_and_a_lone_tensor_are_accepted(tmp_path):
    model = _model()
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    torch.save(torch.ones(3), tmp_path / "t.pt")
    sd = inspect_checkpoints(tmp_path / "sd.pt").files[0]
    assert sd.ckpt.layout == "state_dict" and [t.name for t in sd.tensors][:2] == ["0.weight", "0.bias"]
    lone = inspect_checkpoints(tmp_path / "t.pt").files[0]
    assert lone.ckpt.layout == "tensor" and lone.tensors[0].stats.abs_max == 1.0


def test_empty_float8_parameter_and_sparse_tensors_are_scanned_or_skipped_not_crashed_on(tmp_path):
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=True)
    torch.save({"empty": torch.empty(0, 3), "f8": torch.tensor([0.5, -3.0]).to(torch.float8_e4m3fn),
                "param": nn.Parameter(torch.full((2,), 7.0)), "sparse": sparse}, tmp_path / "c.pt")
    fr = inspect_checkpoints(tmp_path / "c.pt").files[0]
    stats = {t.name: t.stats for t in fr.tensors}
    assert fr.ckpt.non_floating == 1 and set(stats) == {"empty", "f8", "param"}  # sparse is skipped
    assert stats["empty"].abs_max is None and stats["f8"].abs_max == 3.0 and stats["param"].abs_max == 7.0


def test_a_legacy_non_zip_torch_file_is_read_without_mmap(tmp_path):
    model = _model()
    torch.save(model.state_dict(), tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    fr = inspect_checkpoints(tmp_path / "old.pt").files[0]
    assert fr.ckpt.format == "torch-legacy"
    assert _tensor(inspect_checkpoints(tmp_path / "old.pt"), "3.weight").stats.abs_max == (
        model[3].weight.abs().max().item())


def test_a_recorder_snapshot_is_inspected_with_its_batch_as_inputs(tmp_path):
    model = _model()
    batch = {"x": torch.randn(4, 4)}
    batch["x"][1, 2] = float("nan")
    snap = build_snapshot(step=7, reason="nonfinite_loss", model=model, batch=batch,
                          rng={"cpu": torch.get_rng_state(), "cuda": None}, factory="m:f", factory_kwargs={},
                          loss_fn="m:l", amp_dtype=torch.float16, device_type="cpu", scale=1024.0,
                          scaler_state={"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                        "growth_interval": 2000, "_growth_tracker": 3})
    path = write_snapshot(tmp_path / schema.snapshot_name(7, 0, "nonfinite_loss"), snap)
    result = inspect_checkpoints(path)
    fr = result.files[0]
    assert fr.ckpt.layout == "snapshot" and fr.ckpt.step == 7 and fr.ckpt.scaler["scale"] == 1024.0
    assert _tensor(result, "batch.x").role == "input"
    (f,) = result.findings
    assert f.check == "nonfinite_inputs" and f.step == 7 and "batch.x (1 of 16 values)" in f.message


def test_a_snapshot_from_a_newer_format_is_refused_with_the_upgrade_fix(tmp_path):
    model = _model()
    snap = build_snapshot(step=1, reason="manual", model=model, batch={}, rng={}, factory="m:f",
                          factory_kwargs={}, loss_fn="m:l", amp_dtype=None, device_type="cpu")
    snap["format_version"] = schema.FORMAT_VERSION + 1
    torch.save(snap, tmp_path / "s.pt")
    with pytest.raises(VersionError, match="pip install -U amp-autopsy"):
        inspect_checkpoints(tmp_path / "s.pt")


def test_a_noncontiguous_saved_tensor_gives_the_stats_of_its_values(tmp_path):
    x = torch.randn(30, 20) * 1e4
    torch.save({"w": x.t()}, tmp_path / "t.pt")  # saved with transposed strides
    s = _tensor(inspect_checkpoints(tmp_path / "t.pt"), "w").stats
    assert s.abs_max == x.abs().max().item() and s.fp16_overflow == int((x.abs() >= 65520).sum())


# --- findings --------------------------------------------------------------------------------

def test_nan_and_inf_injected_in_adam_exp_avg_sq_are_nonfinite_optimizer_state_naming_the_parameter(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    state = opt.state[model[0].weight]["exp_avg_sq"]
    state[0, :3] = float("nan")
    state[1, 0] = float("inf")
    result = inspect_checkpoints(_save(tmp_path / "c.pt", model, opt, 2))
    (f,) = result.findings
    assert f.check == "nonfinite_optimizer_state" and f.severity == "error" and f.step == 2
    assert f.evidence["tensors"] == [{"name": "optimizer[model.0.weight].exp_avg_sq", "nan": 3, "inf": 1,
                                      "numel": 32}]  # 3 NaN + 1 inf injected into the 8x4 state


def test_a_forward_pass_on_a_nan_batch_poisons_batchnorm_running_stats_and_is_named(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    with torch.no_grad():  # what a step that GradScaler later skips still does to BatchNorm
        model(torch.full((16, 4), float("nan")))
    result = inspect_checkpoints(_save(tmp_path / "c.pt", model, opt, 3))
    (f,) = result.findings
    assert f.check == "nonfinite_buffers"
    assert {t["name"] for t in f.evidence["tensors"]} == {"model.1.running_mean", "model.1.running_var"}
    assert all(t["nan"] == 8 for t in f.evidence["tensors"])  # every one of the 8 channels


def test_a_frozen_layer_is_stalled_between_two_checkpoints_and_has_no_adam_state(tmp_path):
    model = _model()
    model[3].requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    a = _save(tmp_path / "a.pt", model, opt, 2)
    _train(model, opt, 2)
    b = _save(tmp_path / "b.pt", model, opt, 4)
    result = inspect_checkpoints(a, b)
    stalled = sorted(c.name for c in result.changes if c.change.stalled)
    assert stalled == ["model.3.bias", "model.3.weight"]
    assert not [c for c in result.changes if c.became_nonfinite]
    moved = next(c for c in result.changes if c.name == "model.0.weight")
    ref = (model[0].weight - torch.load(a)["model"]["0.weight"]).norm() / torch.load(a)["model"]["0.weight"].norm()
    assert moved.change.rel_change == pytest.approx(ref.item(), rel=1e-5)
    dead = {"no_state" if "no_state" in f.evidence else "stalled": f.evidence
            for f in result.findings if f.check == "dead_optimizer_state"}
    # two findings: B has no Adam state for the head, and the head never moved A -> B
    assert dead["no_state"]["no_state"] == ["model.3.weight", "model.3.bias"]
    assert dead["stalled"]["stalled"] == ["model.3.weight", "model.3.bias"]


def test_weights_that_became_nonfinite_between_a_and_b_are_listed_as_such(tmp_path):
    path_a, model, opt = _trained(tmp_path, "a.pt")
    with torch.no_grad():
        model[0].weight[2, 1] = float("nan")
    path_b = _save(tmp_path / "b.pt", model, opt, 3)
    result = inspect_checkpoints(path_a, path_b)
    assert [c.name for c in result.changes if c.became_nonfinite] == ["model.0.weight"]
    (f,) = [f for f in result.findings if f.check == "nonfinite_weights"]
    assert f.message.startswith("b.pt: ") and f.evidence["tensors"][0]["finite_in_a"] is True


def test_a_pair_with_different_dtypes_is_compared_value_by_value(tmp_path):
    sd = {"w": torch.randn(300, 7)}
    torch.save(sd, tmp_path / "a.pt")
    torch.save({"w": sd["w"].bfloat16()}, tmp_path / "b.pt")
    (c,) = inspect_checkpoints(tmp_path / "a.pt", tmp_path / "b.pt").changes
    # bf16 keeps 8 significant bits: each value moves by at most 2**-9 of itself, so the L2 change does too
    assert 0 < c.change.rel_change <= 2.0**-9 and c.change.changed > 0


def test_identical_checkpoints_are_called_out_rather_than_listing_every_tensor_as_stalled(tmp_path):
    path, _, _ = _trained(tmp_path)
    result = inspect_checkpoints(path, path)
    (f,) = [f for f in result.findings if f.check == "dead_optimizer_state"]
    assert "bit-identical" in f.message and f.evidence["compared"] == len(result.changes)


def test_a_parameter_whose_gradient_is_always_zero_has_an_all_zero_second_moment(tmp_path):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):  # unused gets a gradient tensor, but it is exactly zero
            return self.used(x) + 0.0 * self.unused(x)

    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
    result = inspect_checkpoints(_save(tmp_path / "c.pt", model, opt, 2))
    (f,) = result.findings
    assert f.check == "dead_optimizer_state"
    assert f.evidence["zero_second_moment"] == ["optimizer[model.unused.weight].exp_avg_sq",
                                                "optimizer[model.unused.bias].exp_avg_sq"]


def test_fp16_range_risk_flags_overflowing_values_and_large_products_but_not_a_default_init(tmp_path):
    model = nn.Sequential(nn.Linear(256, 4), nn.Linear(256, 4), nn.Linear(4, 256))
    with torch.no_grad():
        model[0].weight[0, 0] = 7e4          # above 65520: a cast to FP16 gives inf
        model[1].weight.uniform_(-100, 100)  # abs-max ~100 * sqrt(fan_in 256) = ~1600 > 65504/64 = 1023.5
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    (f,) = inspect_checkpoints(tmp_path / "sd.pt").findings
    assert f.check == "fp16_range_risk" and f.severity == "warning"
    reasons = {t["name"]: t["reason"] for t in f.evidence["tensors"]}
    assert reasons == {"0.weight": "value_overflow", "1.weight": "product_overflow"}
    assert "first-order signal" in f.message
    # the product estimate is abs-max * sqrt(256) = 16 * abs-max
    est = next(t["value"] for t in f.evidence["tensors"] if t["name"] == "1.weight")
    assert est == pytest.approx(16 * model[1].weight.abs().max().item())


def test_weights_that_mostly_flush_to_zero_in_fp16_are_a_range_risk(tmp_path):
    torch.save({"w": torch.randn(8, 8) * 1e-9, "ok": torch.randn(8, 8)}, tmp_path / "sd.pt")
    (f,) = inspect_checkpoints(tmp_path / "sd.pt").findings
    (t,) = f.evidence["tensors"]
    # |N(0, 1e-9)| <= 2**-25 ~ 2.98e-8 for essentially every value: the whole tensor becomes zero
    assert t["name"] == "w" and t["reason"] == "underflow" and t["value"] == 1.0


# --- safetensors -----------------------------------------------------------------------------

def _write_safetensors(path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """The format by hand: u64 LE header size, JSON header, little-endian data (8-byte padded header)."""
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
             torch.int8: "I8"}
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_a_hand_written_safetensors_file_with_bf16_and_metadata_is_read(tmp_path):
    w = torch.randn(6, 5)
    w[0, 0] = 1e5
    tensors = {"w": w, "h": torch.randn(7).bfloat16(), "ids": torch.arange(3)}
    _write_safetensors(tmp_path / "m.safetensors", tensors, {"format": "pt"})
    fr = inspect_checkpoints(tmp_path / "m.safetensors").files[0]
    assert fr.ckpt.layout == "safetensors" and fr.ckpt.metadata == {"format": "pt"} and fr.ckpt.non_floating == 1
    stats = {t.name: t for t in fr.tensors}
    assert stats["w"].stats.abs_max == 1e5 and stats["w"].stats.fp16_overflow == 1
    assert stats["h"].dtype == "bfloat16" and stats["h"].stats.abs_max == tensors["h"].abs().max().item()


def test_tensors_that_start_at_odd_offsets_in_a_safetensors_file_are_scanned_exactly(tmp_path):
    # safetensors packs tensors back to back: float32 "w" starts 2 bytes off its 4-byte alignment (after
    # 3 bf16 values) and float16 "h" 1 byte off its 2 (past the int8); torch reads them where they lie
    g = torch.Generator().manual_seed(2)
    w = torch.randn(70_001, generator=g) * 0.02
    w[5], w[60_000], w[61_000] = float("nan"), 1e-9, 7e4
    h = (torch.randn(20_003, generator=g) * 1e4).half()
    h[3] = 0.0
    tensors = {"a": torch.tensor([1.0, -2.0, 3.0]).bfloat16(), "w": w, "b": torch.tensor([0.5]).bfloat16(),
               "odd": torch.ones(1, dtype=torch.int8), "h": h}
    _write_safetensors(tmp_path / "m.safetensors", tensors, {})
    stats = {t.name: t.stats for t in inspect_checkpoints(tmp_path / "m.safetensors").files[0].tensors}
    for name in ("a", "w", "b", "h"):
        assert {k: getattr(stats[name], k) for k in _expected(tensors[name])} == _expected(tensors[name]), name


def test_the_safetensors_package_and_torch_save_give_identical_stats(tmp_path):
    st = require("safetensors.torch", "hf")
    sd = _model().state_dict()
    sd = {k: v for k, v in sd.items() if v.is_floating_point()}
    st.save_file(sd, str(tmp_path / "m.safetensors"))
    torch.save(sd, tmp_path / "m.pt")
    a = inspect_checkpoints(tmp_path / "m.safetensors").files[0]
    b = inspect_checkpoints(tmp_path / "m.pt").files[0]
    assert {t.name: t.to_dict() for t in a.tensors} == {t.name: t.to_dict() for t in b.tensors}


@pytest.mark.parametrize("mangle, expect", [
    (lambda raw: raw[: len(raw) - 10], "truncated"),
    (lambda raw: struct.pack("<Q", 12) + b"{not json!!}" + raw[8:], "not JSON"),
    (lambda raw: raw.replace(b'"F32"', b'"F99"'), "unknown dtype 'F99'"),
])
def test_broken_safetensors_files_are_one_line_errors(tmp_path, mangle, expect):
    _write_safetensors(tmp_path / "ok.safetensors", {"w": torch.randn(4)}, {})
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(mangle((tmp_path / "ok.safetensors").read_bytes()))
    with pytest.raises(BadInputError, match=expect) as e:
        inspect_checkpoints(bad)
    assert "bad.safetensors" in str(e.value) and "\n" not in str(e.value)


# --- bad input and the command line ----------------------------------------------------------

def test_a_truncated_checkpoint_is_a_one_line_error(tmp_path):
    path, _, _ = _trained(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(BadInputError, match="truncated: the archive ends before its index"):
        inspect_checkpoints(path)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_pickled_code_and_modules_are_refused_without_running_anything(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"model": _Payload(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(BadInputError, match="refused") as e:
        inspect_checkpoints(tmp_path / "evil.pt")
    assert not marker.exists()
    assert "state_dict" in str(e.value)  # the safe alternative
    torch.save(_model(), tmp_path / "module.pt")
    with pytest.raises(BadInputError, match="refused: the file holds pickled Python objects"):
        inspect_checkpoints(tmp_path / "module.pt")


@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")  # script and save, both deprecated
def test_torchscript_and_export_archives_are_refused_as_programs_not_checkpoints(tmp_path):
    torch.jit.save(torch.jit.script(nn.Linear(2, 2)), tmp_path / "ts.pt")
    torch.export.save(torch.export.export(nn.Linear(2, 2), (torch.randn(1, 2),)), tmp_path / "ep.pt2")
    with pytest.raises(BadInputError, match=r"refused: a TorchScript archive .* \(torch.save\(model.state_dict\(\)\)"):
        inspect_checkpoints(tmp_path / "ts.pt")
    with pytest.raises(BadInputError, match="refused: a torch.export archive"):
        inspect_checkpoints(tmp_path / "ep.pt2")


def test_a_file_without_floating_point_tensors_is_an_unknown_layout(tmp_path):
    torch.save({"epoch": 3, "ids": torch.arange(4)}, tmp_path / "c.pt")
    expect = r"unknown layout: no floating-point tensors found \(top level: \['epoch', 'ids'\]\)"
    with pytest.raises(BadInputError, match=expect):
        inspect_checkpoints(tmp_path / "c.pt")


def test_the_cli_prints_strict_json_and_text_worst_first(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    opt.state[model[3].weight]["exp_avg_sq"].fill_(float("nan"))
    path = _save(tmp_path / "c.pt", model, opt, 2, scaler={"scale": float("inf"), "growth_factor": 2.0,
                                                           "_growth_tracker": 0})
    res = CliRunner().invoke(main, ["inspect", str(path), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert doc["files"][0]["scaler"] is None  # an infinite scale is no GradScaler's: named, not used
    assert [f["check"] for f in doc["findings"]] == ["nonfinite_optimizer_state", "implausible_checkpoint"]
    assert "scaler.scale inf is not a GradScaler scale" in doc["findings"][1]["message"]
    assert doc["diff"] is None
    text = CliRunner().invoke(main, ["inspect", str(path), "--top", "2"])
    assert text.exit_code == 0
    # 26 = 8 model floats (2 Linear x 2, BatchNorm weight, bias, running_mean, running_var)
    #    + 6 parameters x 3 Adam slots (exp_avg, exp_avg_sq, step)
    rows = text.stdout.split("worst first (top 2 of 26):\n")[1].splitlines()[1:3]
    assert rows[0].split()[:2] == ["optimizer", "optimizer[model.3.weight].exp_avg_sq"]  # all 16 values NaN
    assert "nonfinite_optimizer_state" in text.stdout


def test_the_cli_compares_two_checkpoints(tmp_path):
    path_a, model, opt = _trained(tmp_path, "a.pt")
    _train(model, opt, 1)
    path_b = _save(tmp_path / "b.pt", model, opt, 3)
    res = CliRunner().invoke(main, ["inspect", str(path_a), str(path_b), "--json"])
    assert res.exit_code == 0
    diff = json.loads(res.stdout)["diff"]
    assert diff["stalled"] == [] and diff["became_nonfinite"] == [] and len(diff["changes"]) == 26
    text = CliRunner().invoke(main, ["inspect", str(path_a), str(path_b)]).stdout
    assert "changes a.pt -> b.pt (26 tensors compared)" in text


@pytest.mark.parametrize("content", [b"", b"hello, not a checkpoint", b"PK\x03\x04garbage", b"\x80garbage"])
def test_the_cli_turns_bad_files_into_one_error_line_and_exit_1(tmp_path, content):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(content)
    res = CliRunner().invoke(main, ["inspect", str(bad)])
    assert res.exit_code == 1
    (line,) = res.output.strip().splitlines()
    assert line.startswith("Error: ") and "bad.pt" in line


def test_a_missing_file_is_a_bad_input_error_naming_the_file(tmp_path):
    with pytest.raises(BadInputError, match=r"nope.pt: no such file \(check the path\)"):
        inspect_checkpoints(tmp_path / "nope.pt")


def test_progress_goes_to_stderr_for_large_scans(tmp_path, monkeypatch, capsys):
    path, _, _ = _trained(tmp_path)
    monkeypatch.setattr(_diagnose, "_PROGRESS_MIN_BYTES", 0)  # a tiny file stands in for a large one
    inspect_checkpoints(path, progress=True)
    err = capsys.readouterr().err
    assert err.startswith("\rinspect: ") and err.endswith("GB scanned\n")
    inspect_checkpoints(path, progress=False)
    assert capsys.readouterr().err == ""


def test_render_lists_at_most_top_tensors_per_file(tmp_path):
    path, _, _ = _trained(tmp_path)
    text = render_inspect_text(inspect_checkpoints(path), top=3)
    assert "worst first (top 3 of 26)" in text and "findings: none" in text  # 26: see the CLI test


@pytest.mark.parametrize("fail_on, status", [(None, 0), ("error", 0), ("warning", 4)])
def test_fail_on_exits_4_only_when_a_finding_that_severe_is_present(tmp_path, fail_on, status):
    torch.save({"w": torch.randn(8, 8) * 1e-9}, tmp_path / "sd.pt")  # one fp16_range_risk warning, no error
    args = ["inspect", str(tmp_path / "sd.pt"), "--json"] + (["--fail-on", fail_on] if fail_on else [])
    res = CliRunner().invoke(main, args)
    assert res.exit_code == status
    assert [f["check"] for f in json.loads(res.stdout)["findings"]] == ["fp16_range_risk"]  # printed either way


def test_fail_on_error_exits_4_on_nonfinite_weights_and_0_on_a_healthy_checkpoint(tmp_path):
    path, model, opt = _trained(tmp_path)
    assert CliRunner().invoke(main, ["inspect", str(path), "--fail-on", "warning"]).exit_code == 0
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    bad = _save(tmp_path / "bad.pt", model, opt, 3)
    res = CliRunner().invoke(main, ["inspect", str(bad), "--fail-on", "error"])
    assert res.exit_code == 4 and "nonfinite_weights" in res.stdout


def test_the_device_option_scans_on_the_cpu_and_refuses_cuda_where_there_is_none(tmp_path):
    path, _, _ = _trained(tmp_path)
    cpu = CliRunner().invoke(main, ["inspect", str(path), "--json", "--device", "cpu"])
    auto = CliRunner().invoke(main, ["inspect", str(path), "--json", "--device", "auto"])
    assert cpu.exit_code == auto.exit_code == 0 and json.loads(cpu.stdout) == json.loads(auto.stdout)
    if not torch.cuda.is_available():
        res = CliRunner().invoke(main, ["inspect", str(path), "--device", "cuda"])
        assert res.exit_code == 1 and res.output.startswith("Error: --device cuda: torch sees no CUDA device")

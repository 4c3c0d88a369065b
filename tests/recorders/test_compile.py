"""Recording torch.compile'd models: original names everywhere, and how the model was compiled (format 5)."""
from __future__ import annotations

import json

import polars as pl
import pytest
import torch

from analyzer.load import load_snapshot
from recorders import Recorder, schema
from tests.recorders.models import batches, build_mlp, sgd, train

REFS = {"factory": "tests.recorders.models:build_mlp", "loss_fn": "tests.recorders.models:mse_loss"}
NAMES = [n for n, _ in build_mlp().named_parameters()]  # "0.weight", "0.bias", "1.weight", ...


def record(tmp_path, model, opt_model=None):
    """Three real BF16 steps of `model` (as the loop passes it), then a manual snapshot of a fourth."""
    opt = sgd(opt_model if opt_model is not None else model)
    run = tmp_path / "run"
    data = batches(4)
    with Recorder(run, model, **REFS, amp_dtype=torch.bfloat16, optimizer=opt) as rec:
        train(model, data[:3], rec=rec, opt=opt, amp_dtype=torch.bfloat16)
        rec.begin_step(3, data[3])
        snap = rec.snapshot()
    return run, json.loads((run / "meta.json").read_text()), load_snapshot(snap)


@pytest.mark.slow
def test_a_torch_compiled_model_is_recorded_under_the_original_names_with_its_backend(tmp_path):
    model = torch.compile(build_mlp(), backend="aot_eager")  # aot_eager: this test is about names, not numerics
    assert next(iter(model.state_dict())) == "_orig_mod.0.weight"  # what the recorder must not write
    run, meta, snap = record(tmp_path, model)
    assert meta["format_version"] == schema.FORMAT_VERSION >= 5
    assert [p["name"] for p in meta["params"]] == NAMES
    assert list(snap.model_state) == list(build_mlp().state_dict())
    assert snap.optimizer["param_names"] == NAMES
    layers = pl.read_parquet(run / schema.TRACE_DIR / "layers-*.parquet")
    assert layers["layer"].n_unique() == len(NAMES)  # indexes into meta["params"], which has no _orig_mod.
    entry = {"path": "", "how": "torch.compile", "backend": "aot_eager", "mode": None, "dynamic": None,
             "fullgraph": False, "options": None}
    assert meta["compile"] == snap.compile == {"modules": [entry]}


@pytest.mark.slow
def test_blocks_compiled_in_place_or_wrapped_keep_their_names_and_are_listed(tmp_path):
    model = build_mlp()
    model[0].compile(backend="aot_eager", dynamic=False)  # per block, as torchtitan does: in place
    model[3] = torch.compile(model[3], backend="aot_eager")  # a wrapped submodule: "3._orig_mod.weight"
    assert "3._orig_mod.weight" in dict(model.named_parameters())
    run, meta, snap = record(tmp_path, model)
    assert [p["name"] for p in meta["params"]] == NAMES
    assert list(snap.model_state) == list(build_mlp().state_dict())
    assert snap.optimizer["param_names"] == NAMES
    got = {m["path"]: (m["how"], m["backend"], m["dynamic"]) for m in meta["compile"]["modules"]}
    assert got == {"0": ("module.compile", "aot_eager", False), "3": ("torch.compile", "aot_eager", None)}


def test_a_block_compiled_in_place_and_also_wrapped_is_listed_once_as_the_wrapper_that_runs():
    # accelerate 1.16's compile_regions does both to each block: the in-place compile never runs under the
    # wrapper (its backend is never called), so the record names only the wrapper, as for a plain wrapper
    from recorders.compiled import compile_info

    calls = {"in place": 0, "wrapper": 0}

    def backend(name):
        def compile_fx(gm, example_inputs):
            calls[name] += 1
            return gm.forward
        return compile_fx

    model = build_mlp()
    model[0].compile(backend=backend("in place"))
    model[0] = torch.compile(model[0], backend=backend("wrapper"))
    shared = build_mlp()[3]
    shared.compile(backend="aot_eager")
    model.add_module("again", shared)  # compiled in place and not wrapped: still listed
    model[3] = torch.compile(shared, backend="aot_eager")  # the same module wrapped at another path
    x = torch.randn(4, 8, requires_grad=True)
    model[0](x).sum().backward()
    assert calls == {"in place": 0, "wrapper": 1}
    got = [(m["path"], m["how"]) for m in compile_info(model)["modules"]]
    assert got == [("0", "torch.compile"), ("3", "torch.compile"), ("again", "module.compile")]


def test_inductor_mode_dynamic_and_fullgraph_are_recorded_as_given(tmp_path):
    model = torch.compile(build_mlp(), mode="max-autotune-no-cudagraphs", dynamic=False, fullgraph=True)
    Recorder(tmp_path, model, **REFS).close()  # nothing runs: compiling is lazy, meta.json is written at once
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["compile"]["modules"] == [{"path": "", "how": "torch.compile", "backend": "inductor",
                                          "mode": "max-autotune-no-cudagraphs", "dynamic": False,
                                          "fullgraph": True, "options": None}]
    assert [p["name"] for p in meta["params"]] == NAMES


def test_an_eager_model_records_compile_none(tmp_path):
    Recorder(tmp_path, build_mlp(), **REFS).close()
    assert json.loads((tmp_path / "meta.json").read_text())["compile"] is None

"""A loop that raises inside ``with Recorder(...)``: the step is kept, the exception is untouched.

Real FP16 loops with a GradScaler whose ``clip_grad_norm_(error_if_nonfinite=True)`` raises
(``tests/exception_runs.py``), loops that raise outside any step or are interrupted, and recorder
writes that fail for real while the training exception is being handled.
"""
from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import polars as pl
import pytest
import torch

from analyzer.errors import BadInputError
from analyzer.load import load_snapshot
from analyzer.load.run_dir import read_meta
from recorders import Recorder, schema
from recorders.recorder import RecorderWarning
from recorders.snapshot import build_snapshot, write_snapshot
from tests.exception_runs import CLIP_MESSAGE, CRASH_STEP, clip_batches, clip_loop
from tests.recorders.models import build_mlp, mse_loss

ROOT = Path(__file__).resolve().parents[2]


def _crash(run_dir, **kwargs) -> dict:
    keep: dict = {}
    with pytest.raises(RuntimeError, match=CLIP_MESSAGE) as e:
        clip_loop(run_dir, keep=keep, **kwargs)
    keep["error"] = e.value
    return keep


def _steps(run_dir) -> pl.DataFrame:
    return pl.concat([pl.read_parquet(p) for p in sorted((run_dir / "trace").glob("steps-*.parquet"))]).sort("step")


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("exc") / "run"
    return run_dir, _crash(run_dir)


def test_the_clip_error_propagates_unchanged_with_its_own_traceback(crashed):
    _, keep = crashed
    err = keep["error"]
    assert type(err) is RuntimeError and CLIP_MESSAGE in str(err)
    import traceback

    last = traceback.extract_tb(err.__traceback__)[-1]
    assert last.filename.endswith("clip_grad.py")  # raised by torch, not re-raised by the recorder
    assert keep["recorder"].closed


def test_the_step_that_raised_gets_one_exception_snapshot_of_its_pre_step_state(crashed):
    run_dir, keep = crashed
    names = sorted(p.name for p in (run_dir / "snapshots").iterdir())
    assert names == [schema.snapshot_name(CRASH_STEP, 0, schema.REASON_EXCEPTION)]
    snap = torch.load(run_dir / "snapshots" / names[0], weights_only=True)  # strings only: weights_only loads it
    assert snap["reason"] == "exception" and snap["step"] == CRASH_STEP and snap["format_version"] == schema.FORMAT_VERSION >= 4
    # the optimizer never stepped: the live weights are the pre-step weights the snapshot holds
    for name, t in keep["model"].state_dict().items():
        assert torch.equal(snap["model_state"][name], t)
    assert torch.equal(snap["batch"]["x"], clip_batches(8, CRASH_STEP)[CRASH_STEP]["x"])
    assert snap["scale"] == 256.0 and snap["scaler_state"]["scale"] == 256.0
    assert snap["rng"]["cpu"].dtype == torch.uint8
    exc = snap["exception"]
    assert (exc["type"], exc["step"], exc["last_step"], exc["failure"]) == ("RuntimeError", CRASH_STEP, CRASH_STEP, True)
    assert CLIP_MESSAGE in exc["message"]
    # the user's own line first, then torch's frame that raised
    assert "exception_runs.py" in exc["frames"][0] and "clip_grad_norm_" in exc["frames"][0]
    assert "clip_grad.py" in exc["frames"][-1]


def test_the_snapshot_holds_the_rng_state_begin_step_captured(tmp_path):
    torch.manual_seed(7)
    states: list = []  # the loop draws no random numbers after the start: every begin_step sees this state
    with pytest.raises(RuntimeError, match=CLIP_MESSAGE):
        clip_loop(tmp_path / "run", batches=clip_batches(3, 2), on_start=lambda _: states.append(torch.get_rng_state()))
    snap = torch.load(next((tmp_path / "run" / "snapshots").iterdir()), weights_only=True)
    assert torch.equal(snap["rng"]["cpu"], states[0]) and snap["rng"]["cuda"] is None
    assert not torch.equal(states[0], torch.manual_seed(7).get_state())  # the model's init drew from it before


def test_meta_json_records_the_exception_and_its_step(crashed):
    run_dir, _ = crashed
    meta = read_meta(run_dir / "meta.json")
    assert meta["format_version"] == schema.FORMAT_VERSION >= 4
    assert meta["exception"]["step"] == CRASH_STEP and meta["exception"]["type"] == "RuntimeError"
    assert tuple(meta["exception"]) == schema.EXCEPTION_KEYS and tuple(meta) == schema.META_KEYS


def test_the_step_that_raised_has_a_trace_row_with_its_non_finite_gradients_and_no_loss(crashed):
    run_dir, _ = crashed
    steps = _steps(run_dir)
    assert steps["step"].to_list() == list(range(CRASH_STEP + 1))
    row = steps.row(CRASH_STEP, named=True)
    assert row["loss"] is None  # end_step never got it
    assert row["nonfinite_grads"] > 0 and row["scale"] == 256.0
    assert all(v == 0 for v in steps["nonfinite_grads"].to_list()[:CRASH_STEP])


def test_the_script_still_exits_with_the_clip_runtime_error(tmp_path):
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
            "from tests.exception_runs import clip_loop; clip_loop(Path(sys.argv[2]))")
    res = subprocess.run([sys.executable, "-c", code, str(ROOT), str(tmp_path / "run")], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1].startswith("RuntimeError: The total norm of order 2.0")
    assert "RecorderWarning" not in res.stderr  # no warning of the recorder's own
    assert (tmp_path / "run" / "snapshots" / schema.snapshot_name(CRASH_STEP, 0, "exception")).exists()


def test_at_the_default_init_scale_the_clip_raises_at_step_0_and_step_0_is_kept(tmp_path):
    _crash(tmp_path / "run", init_scale=65536.0)
    snap = load_snapshot(tmp_path / "run" / "snapshots" / schema.snapshot_name(0, 0, "exception"))
    assert snap.step == 0 and snap.scale == 65536.0 and snap.exception["step"] == 0
    assert _steps(tmp_path / "run")["step"].to_list() == [0]


def test_without_a_grad_scaler_the_step_is_kept_with_no_scale(tmp_path):
    _crash(tmp_path / "run", init_scale=None)
    snap = load_snapshot(tmp_path / "run" / "snapshots" / schema.snapshot_name(CRASH_STEP, 0, "exception"))
    assert snap.scale is None and snap.scaler_state is None and snap.exception["step"] == CRASH_STEP
    assert _steps(tmp_path / "run").row(CRASH_STEP, named=True)["scale"] is None


def _loop(run_dir, raise_at: str, exc: BaseException) -> None:
    model = build_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [{"x": torch.randn(4, 8), "y": torch.randn(4, 1)} for _ in range(3)]
    with Recorder(run_dir, model, factory="tests.recorders.models:build_mlp",
                  loss_fn="tests.recorders.models:mse_loss", optimizer=opt) as rec:
        if raise_at == "before":
            raise exc
        for step, batch in enumerate(data):
            rec.begin_step(step, batch)
            loss = mse_loss(model, batch)
            if raise_at == "forward" and step == 1:
                raise exc
            loss.backward()
            rec.end_step(loss)
            if raise_at == "between" and step == 1:
                raise exc  # after end_step: in the optimizer step, the scheduler, the data loader
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("where, step, last", [("before", None, None), ("between", None, 1)])
def test_an_exception_outside_any_open_step_is_recorded_in_meta_json_only(tmp_path, where, step, last):
    with pytest.raises(ValueError, match="data loader broke"):
        _loop(tmp_path, where, ValueError("data loader broke"))
    assert not (tmp_path / "snapshots").exists()
    entry = read_meta(tmp_path / "meta.json")["exception"]
    assert (entry["type"], entry["step"], entry["last_step"], entry["failure"]) == ("ValueError", step, last, True)


def test_an_exception_in_the_forward_keeps_the_step_with_no_gradients(tmp_path):
    with pytest.raises(AssertionError, match="loss is not finite"):
        _loop(tmp_path, "forward", AssertionError("loss is not finite"))
    snap = load_snapshot(tmp_path / "snapshots" / schema.snapshot_name(1, 0, "exception"))
    assert snap.exception["type"] == "AssertionError" and snap.amp_dtype is None
    row = _steps(tmp_path).row(1, named=True)
    assert row["step"] == 1 and row["grad_norm"] is None and row["nonfinite_grads"] is None


def test_a_keyboard_interrupt_inside_a_step_is_no_failure_snapshot(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        _loop(tmp_path, "forward", KeyboardInterrupt())
    assert not (tmp_path / "snapshots").exists()
    entry = read_meta(tmp_path / "meta.json")["exception"]
    assert (entry["type"], entry["step"], entry["failure"]) == ("KeyboardInterrupt", 1, False)  # where, not a failure


class _Unsaveable:
    """A batch entry the snapshot writer refuses (TypeError inside the recorder)."""


@pytest.mark.parametrize("strict", [False, True])
def test_a_recorder_error_while_handling_the_exception_never_replaces_it(tmp_path, strict):
    """The snapshot's own build raises (a batch object it cannot save) and meta.json cannot be
    rewritten (a directory stands in its place): the training exception still propagates, with
    one RecorderWarning, also with strict=True. meta.json is blocked from the crash step on, after
    the recorder's rewrite of it at step 0 (what autocast did)."""
    batches = clip_batches(4, 2)
    batches[2]["meta"] = _Unsaveable()
    keep: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match=CLIP_MESSAGE):
            clip_loop(tmp_path / "run", batches=batches, keep=keep, strict=strict,
                      before_step=lambda step, run_dir: step == 2 and _block_meta(run_dir))
    ours = [w for w in caught if issubclass(w.category, RecorderWarning)]
    assert len(ours) == 1 and "TypeError" in str(ours[0].message)
    # counted, not warned: the snapshot's TypeError, the rewrite of meta.json that keeps that warning, the
    # exception's meta.json entry and close's steps_begun rewrite (4; under strict=True a failure re-raised
    # through an outer guard counts again)
    assert keep["recorder"].write_errors == (6 if strict else 4) and keep["recorder"].closed
    assert not (tmp_path / "run" / "snapshots").exists() or not list((tmp_path / "run" / "snapshots").iterdir())
    assert _steps(tmp_path / "run")["step"].to_list() == [0, 1, 2]  # the trace row was still written


def _block_meta(run_dir: Path) -> None:
    (run_dir / "meta.json").unlink()
    (run_dir / "meta.json").mkdir()


def test_the_exception_entry_round_trips_through_the_snapshot_and_meta_readers(crashed):
    run_dir, _ = crashed
    path = run_dir / "snapshots" / schema.snapshot_name(CRASH_STEP, 0, "exception")
    raw = torch.load(path, weights_only=True)
    snap = load_snapshot(path)
    assert snap.exception == raw["exception"] and snap["exception"] == raw["exception"]
    assert read_meta(run_dir / "meta.json")["exception"] == raw["exception"]


def _old_snapshot(tmp_path, **overrides) -> Path:
    model = build_mlp()
    snap = build_snapshot(step=1, reason="nonfinite_loss", model=model, batch={"x": torch.zeros(1, 8)},
                          rng={"cpu": torch.get_rng_state(), "cuda": None}, factory="tests.recorders.models:build_mlp",
                          factory_kwargs={}, loss_fn="tests.recorders.models:mse_loss", amp_dtype=None,
                          device_type="cpu")
    snap.update(overrides)
    return write_snapshot(tmp_path / "s.pt", snap)


def test_a_format_3_snapshot_without_the_exception_key_still_loads(tmp_path):
    path = _old_snapshot(tmp_path, format_version=3)
    raw = torch.load(path, weights_only=True)
    del raw["exception"]
    torch.save(raw, path)
    snap = load_snapshot(path)
    assert snap.exception is None and "exception" not in snap and snap.format_version == 3


@pytest.mark.parametrize("bad", ["boom", {"type": 3, "message": "x"}, {"type": "E", "message": "x", "frames": [1]},
                                 {"type": "E", "message": "x", "step": "five"}, {"type": "E", "message": "x" * 5000}])
def test_a_malformed_exception_entry_is_one_bad_input_error(tmp_path, bad):
    path = _old_snapshot(tmp_path, exception=bad)
    with pytest.raises(BadInputError, match="snapshot 'exception'"):
        load_snapshot(path)


def test_a_format_3_meta_json_without_the_exception_key_still_reads(crashed, tmp_path):
    run_dir, _ = crashed
    meta = json.loads((run_dir / "meta.json").read_text())
    del meta["exception"]
    meta["format_version"] = 3
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert "exception" not in read_meta(tmp_path / "meta.json")

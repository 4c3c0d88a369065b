"""Every RecorderWarning is kept in meta.json (format 7): its kind, its step and its text, atomically and bounded.

Real loops make each mistake; the test reads meta.json back as the analyzer does (the round trip of the
``warnings`` entry), and checks that training went on.
"""
from __future__ import annotations

import json
import shutil
import warnings

import torch

from recorders import Recorder, schema
from recorders.recorder import RecorderWarning
from tests.recorders.models import batches, build_mlp, mse_loss, sgd

REFS = {"factory": "tests.recorders.models:build_mlp", "loss_fn": "tests.recorders.models:mse_loss"}


def _caught(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RecorderWarning)]


def noisy_scaled_loop(run, n: int = 24) -> list[str]:
    """FP16 autocast + GradScaler whose loop hands end_step a fresh ``scaler.scale(loss)``; each batch's
    targets are multiplied by a factor drawn from 10**U(-1.5, 1.5), so the loss moves by up to 1000x
    between steps, far more than the scale's factor of 2 (the report's trace test cannot see it)."""
    torch.manual_seed(0)
    model, scaler = build_mlp(), torch.amp.GradScaler("cpu", growth_interval=2)
    opt = sgd(model)
    g = torch.Generator().manual_seed(3)
    data = [{**b, "y": b["y"] * 10 ** (3 * torch.rand((), generator=g) - 1.5)} for b in batches(n, size=16)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(run, model, **REFS, scaler=scaler, amp_dtype=torch.float16, optimizer=opt) as rec:
            for step, batch in enumerate(data):
                rec.begin_step(step, batch)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = mse_loss(model, batch)
                scaler.scale(loss).backward()
                rec.end_step(scaler.scale(loss))  # the mistake
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    return _caught(caught)


def test_the_scaled_loss_warning_is_kept_in_meta_json_with_its_kind_and_step(tmp_path):
    caught = noisy_scaled_loop(tmp_path / "run")
    assert len(caught) == 1 and "end_step() was given the scaled loss" in caught[0]
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["format_version"] == schema.FORMAT_VERSION >= 7
    # step 0: the fresh scaler.scale(loss) still holds the scale tensor, so the first end_step sees it
    assert meta["warnings"] == [{"kind": "scaled_loss", "step": 0, "message": caught[0]}]
    assert set(meta["warnings"][0]) == set(schema.WARNING_KEYS) and "scaled_loss" in schema.WARNING_KINDS


def test_a_missing_end_step_is_kept_under_the_step_that_was_not_recorded(tmp_path):
    model = build_mlp()
    opt = sgd(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path / "run", model, **REFS, optimizer=opt) as rec:
            for step, batch in enumerate(batches(4)):
                rec.begin_step(step, batch)
                loss = mse_loss(model, batch)
                loss.backward()
                if step != 1:  # step 1 forgot end_step
                    rec.end_step(loss)
                opt.step()
                opt.zero_grad()
    [msg] = _caught(caught)
    kept = json.loads((tmp_path / "run" / "meta.json").read_text())["warnings"]
    assert kept == [{"kind": "end_step_missing", "step": 1, "message": msg}]


def test_a_write_error_is_kept_with_its_step_and_training_goes_on(tmp_path):
    run = tmp_path / "run"
    model = build_mlp()
    opt = sgd(model)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(run, model, **REFS, optimizer=opt, flush_every=1) as rec:
            for step, batch in enumerate(batches(5)):
                if step == 3:  # the trace directory becomes a file: the next part cannot be written
                    shutil.rmtree(run / "trace")
                    (run / "trace").write_text("not a directory")
                rec.begin_step(step, batch)
                loss = mse_loss(model, batch)
                loss.backward()
                rec.end_step(loss)
                opt.step()
                opt.zero_grad()
                losses.append(float(loss))
    assert len(losses) == 5  # training went on
    [msg] = _caught(caught)
    kept = json.loads((run / "meta.json").read_text())["warnings"]
    assert kept == [{"kind": "write_error", "step": 3, "message": msg}] and "could not write a trace part" in msg


def test_a_warning_issued_before_meta_json_exists_is_written_with_it(tmp_path):
    class NotAnOptimizer:  # check_update needs register_step_post_hook; the warning comes from setup
        param_groups: list = []

        def step(self):
            pass

        def state_dict(self):
            return {}

    model = build_mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path / "run", model, **REFS, optimizer=NotAnOptimizer(), check_update=True) as rec:
            (batch,) = batches(1)
            rec.begin_step(0, batch)
            loss = mse_loss(model, batch)
            loss.backward()
            rec.end_step(loss)
    [msg] = _caught(caught)
    kept = json.loads((tmp_path / "run" / "meta.json").read_text())["warnings"]
    assert kept == [{"kind": "no_step_hook", "step": None, "message": msg}]
    # the warning points at the line that built the Recorder, in this file
    assert [w.filename for w in caught if str(w.message) == msg] == [__file__]


def test_kept_warnings_stop_at_the_cap_and_each_message_is_cut_to_its_limit(tmp_path):
    model = build_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an ignored warning is still kept: the filter is the console's
        with Recorder(tmp_path / "run", model, **REFS) as rec:
            for i in range(schema.MAX_WARNINGS + 8):
                rec._recorder_warning("write_error", f"{i} " + "x" * 5000)
    kept = json.loads((tmp_path / "run" / "meta.json").read_text())["warnings"]
    assert len(kept) == schema.MAX_WARNINGS and kept[-1]["message"].startswith(f"{schema.MAX_WARNINGS - 1} ")
    assert {len(w["message"]) for w in kept} == {schema.MAX_WARNING_CHARS}

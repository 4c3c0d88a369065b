"""The recorder's misuse warnings, on real training loops: a scaled loss, a missing end_step, autocast off.

Each mistake is made the way a first-time user makes it; the test asserts the RecorderWarning's
words (once), what meta.json records, and what ``analyzer report`` says about the run.
"""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main
from recorders import Recorder
from recorders.recorder import RecorderWarning
from tests.recorders.models import batches, build_mlp, mse_loss, sgd

REFS = {"factory": "tests.recorders.models:build_mlp", "loss_fn": "tests.recorders.models:mse_loss"}


def _recorder_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RecorderWarning)]


def _report(run, *args):
    return CliRunner().invoke(main, ["report", str(run), *args])


def _fp16_loop(run, *, record_scaled: bool, n: int = 24):
    """FP16 autocast + GradScaler on CPU, the README's loop; the scaler grows its scale every 2 steps
    (and backs off at overflows), so the scale changes about every other step."""
    torch.manual_seed(0)
    model, scaler = build_mlp(), torch.amp.GradScaler("cpu", growth_interval=2)
    opt = sgd(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(run, model, **REFS, scaler=scaler, amp_dtype=torch.float16, optimizer=opt) as rec:
            for step, batch in enumerate(batches(n, size=256)):  # a loss that varies little between steps
                rec.begin_step(step, batch)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = mse_loss(model, batch)
                scaled = scaler.scale(loss)
                scaled.backward()
                rec.end_step(scaled if record_scaled else loss)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    return _recorder_warnings(caught)


def test_end_step_given_the_scaled_loss_warns_once_naming_the_unscaled_loss(tmp_path):
    caught = _fp16_loop(tmp_path / "run", record_scaled=True)
    assert len(caught) == 1, caught
    assert caught[0].startswith("amp-autopsy recorder: end_step() was given the scaled loss (loss x the GradScaler's "
                                "scale, ")
    assert caught[0].endswith("so the trace records loss x scale. Pass the unscaled loss: "
                              "scaler.scale(loss).backward(); rec.end_step(loss)")
    # the report's check sees the same thing in the trace alone
    result = _report(tmp_path / "run", "--json")
    assert result.exit_code == 0, result.output
    (finding,) = [f for f in json.loads(result.output)["findings"] if f["check"] == "scaled_loss"]
    assert finding["severity"] == "warning" and finding["evidence"]["followed"] >= 3
    assert "so the trace holds loss x scale: end_step was given scaler.scale(loss)" in finding["message"]


def test_the_unscaled_loss_gives_no_warning_and_no_scaled_loss_finding(tmp_path):
    assert _fp16_loop(tmp_path / "run", record_scaled=False) == []
    result = _report(tmp_path / "run", "--json")
    assert result.exit_code == 0, result.output
    checks = [f["check"] for f in json.loads(result.output)["findings"]]
    assert "scaled_loss" not in checks and "autocast_inactive" not in checks
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["steps_begun"] == 24
    assert meta["autocast"] == {"device_type": "cpu", "enabled": True, "dtype": "float16", "active_on": [],
                                "step": 0}


def test_begin_step_without_end_step_warns_at_the_next_begin_step_and_the_report_names_the_cause(tmp_path):
    torch.manual_seed(0)
    model = build_mlp()
    opt = sgd(model)
    run = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(run, model, **REFS, optimizer=opt) as rec:
            for step, batch in enumerate(batches(5)):
                rec.begin_step(step, batch)
                mse_loss(model, batch).backward()  # no rec.end_step(loss)
                opt.step()
                opt.zero_grad()
    assert _recorder_warnings(caught) == [
        "amp-autopsy recorder: begin_step(1) came before end_step() of step 0, so step 0 was not recorded. Call "
        "rec.end_step(loss) with the unscaled loss after backward and before optimizer.step() on every step"]
    assert json.loads((run / "meta.json").read_text())["steps_begun"] == 5
    for command in ("report", "autopsy"):
        result = CliRunner().invoke(main, [command, str(run)])
        assert result.exit_code == 1, result.output
        assert result.output.strip() == (
            f"Error: {run}: empty trace: begin_step ran 5 time(s) but end_step never recorded a step (call "
            "rec.end_step(loss) with the unscaled loss after backward, before optimizer.step(), on every step)")


def test_a_single_begin_step_never_ended_warns_at_close(tmp_path):
    model = build_mlp()
    with pytest.warns(RecorderWarning, match=r"begin_step ran 1 time\(s\) but end_step\(\) never did"):
        with Recorder(tmp_path / "run", model, **REFS) as rec:
            (batch,) = batches(1)
            rec.begin_step(0, batch)
            mse_loss(model, batch).backward()


def test_a_run_killed_mid_step_after_recorded_steps_does_not_warn_about_end_step(tmp_path):
    # the last step of an interrupted run began and never ended: that is no misuse
    model = build_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecorderWarning)
        with Recorder(tmp_path / "run", model, **REFS) as rec:
            for step, batch in enumerate(batches(3)):
                rec.begin_step(step, batch)
                loss = mse_loss(model, batch)
                loss.backward()
                if step < 2:
                    rec.end_step(loss)


def test_autocast_for_cuda_around_a_cpu_model_warns_that_the_run_trains_in_fp32(tmp_path):
    # The README's torch.autocast("cuda", ...) copied onto a CPU run: torch disables it (one
    # UserWarning of its own), so the FP16 recorder watches an FP32 run.
    torch.manual_seed(0)
    model, scaler = build_mlp(), torch.amp.GradScaler("cpu")
    opt = sgd(model)
    run = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(run, model, **REFS, scaler=scaler, amp_dtype=torch.float16, optimizer=opt) as rec:
            for step, batch in enumerate(batches(6)):
                rec.begin_step(step, batch)
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = mse_loss(model, batch)
                scaler.scale(loss).backward()
                rec.end_step(loss)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    assert _recorder_warnings(caught) == [
        "amp-autopsy recorder: amp_dtype=float16 but autocast was not active on cpu during the forward of step 0, "
        "so this run trains in FP32: no autocast region was active for cpu (torch.autocast on another device type "
        "does nothing here, and torch.autocast(\"cuda\") without CUDA disables itself). Run the forward under "
        "torch.autocast(device_type='cpu', dtype=torch.float16), with device_type taken from the model "
        "(next(model.parameters()).device.type), or pass amp_dtype=None for an FP32 run"]
    meta = json.loads((run / "meta.json").read_text())
    assert meta["autocast"] == {"device_type": "cpu", "enabled": False, "dtype": None, "active_on": [], "step": 0,
                                "inside_forward": False}  # FP32 outputs: no autocast inside the forward either
    assert not model._forward_pre_hooks  # the one-time hook is gone
    text = _report(run)
    assert text.exit_code == 0, text.output
    header = text.output.splitlines()[0]
    assert "autocast was not active during the forward: this run trained in FP32" in header
    assert "float16 AMP" not in text.output
    (finding,) = [f for f in json.loads(_report(run, "--json").output)["findings"] if f["check"] == "autocast_inactive"]
    assert finding["severity"] == "warning" and finding["evidence"]["device_type"] == "cpu"


def test_an_eval_forward_before_training_is_not_taken_for_the_training_forward(tmp_path):
    # A sanity forward without autocast under no_grad, before the loop: the check waits for the
    # first training forward of a step.
    model = build_mlp()
    opt = sgd(model)
    (batch,) = batches(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecorderWarning)
        with Recorder(tmp_path / "run", model, **REFS, amp_dtype=torch.bfloat16, optimizer=opt) as rec:
            with torch.no_grad():
                model(batch["x"])
            rec.begin_step(0, batch)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = mse_loss(model, batch)
            loss.backward()
            rec.end_step(loss)
    assert json.loads((tmp_path / "run" / "meta.json").read_text())["autocast"]["enabled"] is True


def test_an_amp_dtype_other_than_autocasts_warns_with_the_dtype_autocast_runs_in(tmp_path):
    model = build_mlp()
    opt = sgd(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path / "run", model, **REFS, amp_dtype=torch.float16, optimizer=opt) as rec:
            for step, batch in enumerate(batches(2)):
                rec.begin_step(step, batch)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = mse_loss(model, batch)
                loss.backward()
                rec.end_step(loss)
                opt.step()
                opt.zero_grad()
    assert _recorder_warnings(caught) == [
        "amp-autopsy recorder: amp_dtype=float16 but autocast on cpu runs in bfloat16 (step 0): pass "
        "amp_dtype=torch.bfloat16 so that the report and replay use the precision this run trains in"]


def test_a_compiled_model_is_observed_under_autocast_without_a_warning_or_a_recompile(tmp_path):
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model = build_mlp()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    opt = sgd(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecorderWarning)
        with Recorder(tmp_path / "run", model, **REFS, amp_dtype=torch.bfloat16, optimizer=opt) as rec:
            for step, batch in enumerate(batches(3)):
                rec.begin_step(step, batch)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = torch.nn.functional.mse_loss(compiled(batch["x"]).float(), batch["y"])
                loss.backward()
                rec.end_step(loss)
                opt.step()
                opt.zero_grad()
                if step == 0:
                    after_first = counter.frame_count
    seen = json.loads((tmp_path / "run" / "meta.json").read_text())["autocast"]
    assert (seen["enabled"], seen["dtype"]) == (True, "bfloat16")
    # the root's hook runs before the graph, which stays whole; removing it after step 0 recompiled nothing
    assert counter.frame_count == after_first == 1


def _readme_recorder_loop() -> str:
    """The python block of README.md's "Add the recorder to your own loop" section."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("## Add the recorder to your own loop", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)[0]  # the loop; the later ones are variants


def test_the_readmes_recorder_loop_passes_the_unscaled_loss_and_the_models_device_type():
    code = _readme_recorder_loop()
    assert "rec.end_step(loss)" in code and "end_step(scaler.scale" not in code
    assert "device_type = next(model.parameters()).device.type" in code
    assert "torch.autocast(device_type, dtype=torch.float16)" in code  # the model's device, not "cuda"


def test_the_readmes_recorder_loop_runs_as_written_on_cpu_without_a_recorder_warning(tmp_path, monkeypatch):
    # The snippet verbatim, with its placeholders bound: a CPU model, a GradScaler, a loader. Had it
    # passed scaler.scale(loss) or named autocast's device type "cuda", the recorder would warn.
    code = (_readme_recorder_loop().replace("mypkg.model:build", REFS["factory"])
            .replace("mypkg.model:loss", REFS["loss_fn"]))
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = build_mlp()
    scope = {"torch": torch, "model": model, "cfg": {}, "scaler": torch.amp.GradScaler("cpu"), "opt": sgd(model),
             "loader": batches(6), "loss_fn": mse_loss}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(code, "README.md", "exec"), scope)
    assert _recorder_warnings(caught) == []
    meta = json.loads((tmp_path / "runs" / "exp1" / "meta.json").read_text())
    assert meta["autocast"]["enabled"] is True and meta["steps_begun"] == 6
    result = _report(tmp_path / "runs" / "exp1", "--json")
    assert result.exit_code == 0, result.output
    checks = {f["check"] for f in json.loads(result.output)["findings"]}
    assert not checks & {"scaled_loss", "autocast_inactive"}


def test_a_scaled_loss_the_recorder_cannot_see_is_caught_by_the_reports_check_alone(tmp_path):
    # scaler.scale(loss).detach() has no autograd node to recognise: the trace alone shows that
    # the recorded loss doubles and halves with the scale
    torch.manual_seed(0)
    model, scaler = build_mlp(), torch.amp.GradScaler("cpu", growth_interval=2)
    opt = sgd(model)
    run = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(run, model, **REFS, scaler=scaler, amp_dtype=torch.float16, optimizer=opt) as rec:
            for step, batch in enumerate(batches(24, size=256)):
                rec.begin_step(step, batch)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = mse_loss(model, batch)
                scaled = scaler.scale(loss)
                scaled.backward()
                rec.end_step(scaled.detach())
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    assert not [w for w in _recorder_warnings(caught) if "scaled loss" in w]
    text = _report(run)
    assert text.exit_code == 0, text.output
    assert "scaled_loss" in text.output and "so the trace holds loss x scale: end_step was given scaler.scale(loss)" \
        in text.output
    (f,) = [f for f in json.loads(_report(run, "--json").output)["findings"] if f["check"] == "scaled_loss"]
    assert f["severity"] == "warning" and f["evidence"]["followed"] >= 3
    assert f["evidence"]["loss_after"] / f["evidence"]["loss_before"] == pytest.approx(
        f["evidence"]["scale_after"] / f["evidence"]["scale_before"], rel=0.5)

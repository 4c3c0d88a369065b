"""The recorder never takes training down: write errors warn once; kill -9 leaves a readable run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import polars as pl
import pytest
import torch

from recorders import Recorder, schema
from recorders.recorder import RecorderWarning
from tests.recorders.models import batches, build_mlp, train

REFS = {"factory": "tests.recorders.models:build_mlp", "loss_fn": "tests.recorders.models:mse_loss"}
ROOT = Path(__file__).resolve().parents[2]


def plain_run(n=6):
    torch.manual_seed(5)
    model = build_mlp()
    train(model, batches(n))
    return model.state_dict()


def recorded_run(run_dir, n=6, **kw):
    torch.manual_seed(5)
    model = build_mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(run_dir, model, **REFS, flush_every=2, **kw) as rec:
            train(model, batches(n), rec=rec)
            rec.snapshot()
    return model.state_dict(), rec, [w for w in caught if issubclass(w.category, RecorderWarning)]


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_trace_directory_that_cannot_be_written_warns_once_and_training_goes_on(tmp_path):
    (tmp_path / "trace").write_text("a file where the trace directory should be")
    state, rec, warned = recorded_run(tmp_path)
    assert len(warned) == 1
    message = str(warned[0].message)
    assert str(tmp_path) in message and "FileExistsError" in message and "write a trace part" in message
    assert rec.write_errors == 3  # 6 steps, flush_every 2: three failed parts, one warning
    assert same(state, plain_run())
    assert len(rec.snapshots) == 1  # the snapshot directory was fine


def test_a_full_disk_warns_once_and_training_goes_on(tmp_path):
    # Real ENOSPC: the temporary file of the first part is a link to /dev/full.
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    (tmp_path / "trace").mkdir()
    tmp = tmp_path / "trace" / f".{schema.part_name('steps', 0, 0)}.{os.getpid()}.tmp"
    tmp.symlink_to("/dev/full")
    state, rec, warned = recorded_run(tmp_path)
    assert len(warned) == 1 and "No space left on device" in str(warned[0].message)
    assert rec.write_errors == 1
    assert same(state, plain_run())
    # the failed part is simply absent; the later parts are intact and readable
    steps = pl.read_parquet(tmp_path / "trace" / schema.STEPS_GLOB)
    assert sorted(steps["step"].to_list()) == [2, 3, 4, 5]
    assert not tmp.exists()


def test_a_run_directory_that_cannot_be_created_warns_once_stops_recording_and_training_goes_on(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    state, rec, warned = recorded_run(blocker / "run")
    assert len(warned) == 1 and "meta.json" in str(warned[0].message)
    assert "stopped recording" in str(warned[0].message)
    assert rec.stopped and rec.snapshots == []
    assert rec.write_errors == 1  # the start; nothing is attempted after it
    assert same(state, plain_run())


def test_a_snapshot_that_cannot_be_written_returns_none_after_a_warning(tmp_path):
    (tmp_path / "snapshots").write_text("in the way")
    model = build_mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, model, **REFS) as rec:
            rec.begin_step(0, batches(1)[0])
            assert rec.snapshot() is None
    assert [w.category for w in caught] == [RecorderWarning]
    assert "snapshot" in str(caught[0].message)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_a_read_only_run_directory_warns_once_and_training_goes_on(tmp_path):
    tmp_path.chmod(0o500)
    try:
        state, rec, warned = recorded_run(tmp_path / "run")
    finally:
        tmp_path.chmod(0o700)
    assert len(warned) == 1 and rec.write_errors > 0
    assert same(state, plain_run())


def test_strict_mode_raises_the_write_error_instead(tmp_path):
    (tmp_path / "trace").write_text("in the way")
    model = build_mlp()
    rec = Recorder(tmp_path, model, **REFS, flush_every=1, strict=True)
    rec.begin_step(0, batches(1)[0])
    loss = model(torch.ones(1, 8)).sum()
    loss.backward()
    with pytest.raises(FileExistsError):
        rec.end_step(loss)


CHILD = textwrap.dedent("""
    import sys, torch
    from recorders import Recorder
    from tests.recorders.models import batches, build_mlp, train
    torch.set_num_threads(1)
    model = build_mlp(width=32, depth=3)
    rec = Recorder(sys.argv[1], model, factory="tests.recorders.models:build_mlp",
                   loss_fn="tests.recorders.models:mse_loss", flush_every=2)
    data = batches(1, width=32)
    while True:
        train(model, data * 50, rec=rec)
""")


def test_kill_9_mid_run_leaves_every_part_readable_and_all_flushed_steps(tmp_path):
    run = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(run)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while len(list((run / "trace").glob(schema.LAYERS_GLOB))) < 8:
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "the child recorded nothing in 60 s"
            time.sleep(0.01)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL

    trace = run / "trace"
    steps_parts = sorted(trace.glob(schema.STEPS_GLOB))
    layer_parts = sorted(trace.glob(schema.LAYERS_GLOB))
    frames = [pl.read_parquet(p) for p in steps_parts]  # every visible part reads
    assert all(f.height == 2 for f in frames)  # flush_every 2: each part holds whole flushes
    # the train() loop restarts its step count every 50 steps; each part holds steps 2k, 2k+1
    assert [f["step"].to_list() for f in frames] == [[2 * (i % 25), 2 * (i % 25) + 1] for i in range(len(frames))]
    for p in layer_parts:
        layers = pl.read_parquet(p)
        assert layers.height == 2 * 14  # build_mlp(32, 3): 3 x (Linear + LayerNorm) + Linear = 14 params
        # a layers part is written after its steps part, so its steps part exists too
        assert (trace / p.name.replace("layers", "steps")).exists()
    assert len(steps_parts) - len(layer_parts) in (0, 1)
    leftovers = [p.name for p in trace.iterdir() if p not in steps_parts and p not in layer_parts]
    assert all(name.startswith(".") and name.endswith(".tmp") for name in leftovers)


EXIT_WITHOUT_CLOSE = textwrap.dedent("""
    import sys
    from recorders import Recorder
    from tests.recorders.models import batches, build_mlp, train
    model = build_mlp()
    rec = Recorder(sys.argv[1], model, flush_every=100)
    train(model, batches(3), rec=rec)
    # no rec.close(): the interpreter's exit flushes
""")


def test_a_script_that_forgets_close_still_flushes_its_steps_at_exit(tmp_path):
    subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(tmp_path)], cwd=ROOT, check=True,
                   timeout=120)
    assert pl.read_parquet(tmp_path / "trace" / schema.STEPS_GLOB)["step"].to_list() == [0, 1, 2]

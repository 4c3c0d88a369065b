"""Several processes in one run directory: parts and meta files are claimed, never overwritten;
a second process on one rank is its own writer, warned at start and read as its own stream."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzer.load import load_snapshot
from analyzer.report import build_report
from analyzer.load import load_run, snapshot_info
from recorders import Recorder, schema
from recorders._io import claim_write
from recorders.recorder import RecorderWarning
from recorders.trace import TraceWriter
from tests.recorders.models import batches, build_mlp, train

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
REFS = {"factory": "tests.recorders.models:build_mlp", "loss_fn": "tests.recorders.models:mse_loss"}


@pytest.fixture(scope="module")
def two_writers(tmp_path_factory):
    """Two real processes record rank 0 of one directory at once, flushing a part every step."""
    tmp = tmp_path_factory.mktemp("writers")
    run, sync = tmp / "run", tmp / "sync"
    sync.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.recorders.concurrent_child", str(run), str(sync),
                               name, str(seed), str(STEPS)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, seed in (("a", 1), ("b", 2))]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
    children = [json.loads((sync / f"{n}.json").read_text()) for n in ("a", "b")]
    return run, sorted(children, key=lambda c: c["writer"])


def test_two_processes_recording_one_rank_in_one_directory_lose_no_row(two_writers):
    run, (first, second) = two_writers
    assert (first["writer"], second["writer"]) == (0, 1)
    names = set(os.listdir(run / schema.TRACE_DIR))
    assert {schema.part_name("steps", 0, i) for i in range(STEPS)} <= names
    assert {schema.part_name("steps", 0, i, writer=1) for i in range(STEPS)} <= names
    steps = pl.read_parquet(sorted((run / schema.TRACE_DIR).glob(schema.STEPS_GLOB)))
    assert steps.height == 2 * STEPS


def test_only_the_second_process_warns_once_naming_the_first(two_writers):
    _, (first, second) = two_writers
    assert first["warnings"] == []
    assert len(second["warnings"]) == 1
    message = second["warnings"][0]
    assert f"pid {first['pid']} on host {socket.gethostname()}" in message and "writer 1" in message


def test_the_reader_keeps_each_process_as_its_own_stream_and_names_both(two_writers):
    run, (first, second) = two_writers
    loaded = load_run(run)
    assert loaded.writers == {1: (0, 1)}
    host = socket.gethostname()
    assert any(n.startswith(f"2 processes wrote rank 0: pid {first['pid']} on host {host}, "
                            f"pid {second['pid']} on host {host}") for n in loaded.notes)
    steps = loaded.steps.collect().sort("rank", "step")
    # never mixed: each stream holds exactly its own process's losses, in step order
    for rank, child in ((0, first), (1, second)):
        mine = steps.filter(pl.col("rank") == rank)
        assert mine["step"].to_list() == list(range(STEPS))
        assert mine["loss"].to_list() == pytest.approx(child["losses"], rel=1e-7)
    assert loaded.layers.collect().group_by("rank").len().sort("rank")["len"].to_list() == [STEPS * 10] * 2
    report = build_report(run)
    assert any("2 processes wrote rank 0" in n for n in report.notes)
    assert report.frames.n_ranks == 2


def test_a_taken_part_name_is_skipped_not_overwritten(tmp_path):
    trace = tmp_path / schema.TRACE_DIR
    trace.mkdir()
    (trace / schema.part_name("steps", 0, 0)).write_bytes(b"another process's part")
    writer = TraceWriter(tmp_path, 0)
    writer.next_index = 0  # as if built before the other process wrote
    row = {"step": 7, "rank": 0, "wall_time": 0.0, "loss": 1.0, "loss_dtype": "float32", "scale": None,
           "skipped": None, "grad_norm": 1.0, "lr": None, "nonfinite_grads": 0}
    [path] = writer.write([row], None)
    assert path.name == schema.part_name("steps", 0, 1)
    assert (trace / schema.part_name("steps", 0, 0)).read_bytes() == b"another process's part"
    assert pl.read_parquet(path)["step"].to_list() == [7]
    assert writer.next_index == 2
    assert [n for n in os.listdir(trace) if n.startswith(".")] == []  # no temporary file left


def test_claim_write_takes_the_first_free_index(tmp_path):
    for i in (0, 1, 3):
        (tmp_path / f"p{i}").write_text("taken")
    path, index = claim_write(lambda i: tmp_path / f"p{i}", 0, lambda f: f.write(b"mine"))
    assert (path.name, index) == ("p2", 2) and path.read_bytes() == b"mine"
    assert [(tmp_path / f"p{i}").read_text() for i in (0, 1, 3)] == ["taken"] * 3


@settings(max_examples=60, deadline=None)
@given(step=st.integers(0, 10**8 - 1), rank=st.integers(0, 99999), writer=st.integers(0, 999),
       index=st.integers(0, 999999), reason=st.text(min_size=0, max_size=20))
def test_writer_file_names_round_trip_through_the_readers_patterns(step, rank, writer, index, reason):
    meta = schema.META_RE.match(schema.meta_name(rank, writer))
    assert (int(meta[1] or 0), int(meta[2] or 0)) == (rank, writer)
    for kind in ("steps", "layers"):
        part = schema.PART_RE.match(schema.part_name(kind, rank, index, writer))
        assert (part[1], int(part[2]), int(part[3] or 0), int(part[4])) == (kind, rank, writer, index)
    name = schema.snapshot_name(step, rank, reason, writer)
    info = snapshot_info(Path(name))
    assert (info["step"], info["rank"], info["writer"]) == (step, rank, writer)
    assert info["reason"] == ("".join(c if c.isalnum() or c == "_" else "_" for c in reason) or "manual")


def test_writer_zero_keeps_the_version_1_names():
    assert schema.meta_name(0) == "meta.json" and schema.meta_name(3) == "meta-r00003.json"
    assert schema.part_name("steps", 0, 2) == "steps-r00000-p000002.parquet"
    assert schema.snapshot_name(42, 0, "nonfinite_loss") == "step00000042-r00000-nonfinite_loss.pt"
    assert schema.meta_name(0, 1) == "meta-r00000-w1.json"
    assert schema.part_name("layers", 0, 2, 1) == "layers-r00000-w1-p000002.parquet"
    assert schema.snapshot_name(42, 0, "manual", 1) == "step00000042-r00000-w1-manual.pt"


def test_a_second_recorder_of_this_process_while_the_first_is_open_is_writer_1(tmp_path):
    with pytest.warns(RecorderWarning, match="already being recorded"):
        a, b = Recorder(tmp_path, build_mlp(), **REFS), Recorder(tmp_path, build_mlp(), **REFS)
    assert (a.writer, b.writer) == (0, 1)
    b.close()
    a.close()
    with Recorder(tmp_path, build_mlp(), **REFS) as c:  # both closed: a resumed run takes writer 0
        assert c.writer == 0


def test_a_run_directory_with_glob_characters_in_its_name_is_read(tmp_path):
    run = tmp_path / "exp[lr=0.3]*?"
    model = build_mlp()
    batch = batches(3)
    batch[2]["x"][0, 0] = float("nan")
    with Recorder(run, model, **REFS, flush_every=2) as rec:
        train(model, batch, rec=rec)
    loaded = load_run(run)
    assert loaded.steps.collect()["step"].to_list() == [0, 1, 2]
    assert [p.name for p in loaded.snapshots] == [schema.snapshot_name(2, 0, "nonfinite_loss")]
    assert build_report(run).frames.n_ranks == 1


def _downgrade_to_version_1(run: Path) -> None:
    """Rewrite a run's meta.json and snapshots as a version-1 recorder wrote them (no cwd)."""
    meta = json.loads((run / "meta.json").read_text())
    del meta["cwd"]
    meta["format_version"] = 1
    (run / "meta.json").write_text(json.dumps(meta))
    for snap_path in (run / "snapshots").iterdir():
        snap = torch.load(snap_path, weights_only=True)
        del snap["cwd"]
        snap["format_version"] = 1
        torch.save(snap, snap_path)


def test_a_version_1_run_without_cwd_is_still_read(tmp_path):
    model = build_mlp()
    data = batches(4)
    data[3]["y"][0, 0] = float("inf")
    with Recorder(tmp_path, model, **REFS, flush_every=2) as rec:
        train(model, data, rec=rec)
    _downgrade_to_version_1(tmp_path)
    loaded = load_run(tmp_path)
    assert loaded.meta["format_version"] == 1 and "cwd" not in loaded.meta
    assert loaded.steps.collect()["step"].to_list() == [0, 1, 2, 3] and loaded.notes == []
    [snap_path] = loaded.snapshots
    snap = load_snapshot(snap_path)
    assert snap["format_version"] == 1 and "cwd" not in snap and snap["step"] == 3


def test_meta_and_snapshots_record_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = build_mlp()
    data = batches(2)
    data[1]["y"][0, 0] = float("nan")
    with Recorder(tmp_path / "run", model, **REFS) as rec:
        train(model, data, rec=rec)
    assert json.loads((tmp_path / "run" / "meta.json").read_text())["cwd"] == str(tmp_path)
    assert load_snapshot(rec.snapshots[0])["cwd"] == str(tmp_path)


def test_a_resumed_run_failing_at_the_same_step_keeps_the_earlier_snapshot(tmp_path):
    data = batches(3)
    data[2]["y"][0, 0] = float("nan")
    for seed in (0, 1):  # two runs, one after the other, both fail at step 2
        model = build_mlp(seed=seed)
        with Recorder(tmp_path, model, **REFS) as rec:
            train(model, data, rec=rec)
    names = sorted(p.name for p in (tmp_path / schema.SNAPSHOT_DIR).iterdir())
    assert names == [schema.snapshot_name(2, 0, "nonfinite_loss"), schema.snapshot_name(2, 0, "nonfinite_loss_2")]
    first, second = (load_snapshot(tmp_path / schema.SNAPSHOT_DIR / n) for n in names)
    assert first["reason"] == second["reason"] == "nonfinite_loss"
    # different seeds, so different weights at step 2: both processes' snapshots survive
    assert not torch.equal(first["model_state"]["0.weight"], second["model_state"]["0.weight"])


def test_a_second_manual_snapshot_of_one_step_replaces_this_recorders_own_file(tmp_path):
    model = build_mlp()
    with Recorder(tmp_path, model, **REFS) as rec:
        rec.begin_step(0, batches(1)[0])
        a = rec.snapshot()
        b = rec.snapshot()
    assert a == b and rec.snapshots == [a]
    assert [p.name for p in (tmp_path / schema.SNAPSHOT_DIR).iterdir()] == [a.name]


def test_a_recorder_dropped_without_close_gives_its_writer_slot_back(tmp_path):
    import gc

    rec = Recorder(tmp_path, build_mlp(), **REFS)
    assert rec.writer == 0
    del rec
    gc.collect()
    with Recorder(tmp_path, build_mlp(), **REFS) as again:
        assert again.writer == 0


def test_without_hard_links_names_are_still_claimed_exclusively(tmp_path, monkeypatch):
    import errno

    def no_links(src, dst):  # what a filesystem without hard links answers (some FUSE, SMB mounts)
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    (tmp_path / "p0").write_text("taken")
    path, index = claim_write(lambda i: tmp_path / f"p{i}", 0, lambda f: f.write(b"mine"))
    assert (path.name, index) == ("p1", 1) and path.read_bytes() == b"mine"
    assert (tmp_path / "p0").read_text() == "taken"
    assert sorted(os.listdir(tmp_path)) == ["p0", "p1"]  # no temporary file left

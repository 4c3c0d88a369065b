"""bench/gpu_check.sh on CPU: the dry run lists and checks every command; a real run needs CUDA.

No GPU is lent to CI, so the real check cannot run here. What can be proved on CPU is that the
dry run names every step of the GPU check, that each script it calls exists and accepts
the options it passes, that its table says nothing was measured, and that the CUDA-vs-CPU
replay comparison it relies on (bench/replay_devices.py) works end to end on a real sample.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def _replay_devices():
    spec = importlib.util.spec_from_file_location("replay_devices", ROOT / "bench" / "replay_devices.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpu_check(*args: str, out: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PYTHON"] = sys.executable
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


def _table(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ")]


def test_the_dry_run_lists_every_step_checks_its_options_and_writes_a_table_of_nothing_measured(tmp_path):
    res = _gpu_check("--dry-run", out=tmp_path / "out")
    assert res.returncode == 0, res.stdout + res.stderr
    listing = res.stdout
    assert "DRY RUN" in listing and "MISSING" not in listing
    assert f"CUDA available here: {'yes' if torch.cuda.is_available() else 'no'}" in listing
    for command in ("-m pytest -m cuda",
                    "bench/replay_devices.py --device cuda",
                    "bench/recorder_overhead.py --device cuda --dtype fp16 --size 100m",
                    "bench/recorder_overhead.py --device cuda --dtype bf16 --size 100m",
                    "bench/replay_cost.py --device cuda"):
        assert command in listing, command
    for name in _replay_devices().discover_samples():  # every sample is trained and replayed twice
        assert f"-m samples.{name} " in listing
        replays = [line for line in listing.splitlines() if f"samples/{name}/snapshots/<first snapshot>" in line]
        assert [line.split("--device ")[1] for line in replays] == ["cpu --json", "cuda --json"]
    collected = [line.strip() for line in listing.splitlines() if line.strip().startswith("tests/") and "::" in line]
    assert collected and f"collects {len(collected)} test(s)" in listing
    # Each step's timeout is listed, and they add up to less than the 8 minutes the check may take.
    timeouts = [int(line.split("timeout ")[1].split(" s]")[0]) for line in listing.splitlines() if " s] " in line]
    assert len(timeouts) == 5 and sum(timeouts) < 480

    written = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "nothing was measured and no GPU run has been made" in written
    rows = _table(written)
    assert rows[0] == ["check", "measured", "target", "result"]
    body = rows[1:]  # (the |---| line is not a row)
    assert [r[0] for r in body][-1] == "total wall time" and len(body) == 6
    assert all(r[1] == "not run (dry run, no GPU)" and r[3] == "not run" for r in body)
    assert any("1.02x" in r[2] for r in body) and any("1.5x" in r[2] for r in body)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal shown without CUDA")
def test_a_real_run_without_cuda_is_refused_with_one_error_line_and_writes_nothing(tmp_path):
    res = _gpu_check(out=tmp_path / "out", timeout=120)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and "--dry-run" in lines[0]
    assert not (tmp_path / "out").exists()


def test_an_unknown_option_is_refused_with_exit_2_and_one_error_line():
    res = _gpu_check("--gpu", timeout=60)
    assert res.returncode == 2
    assert res.stderr.startswith("Error:") and len(res.stderr.strip().splitlines()) == 1 and "--gpu" in res.stderr


def test_replay_devices_gives_a_run_without_a_snapshot_a_not_applicable_row(tmp_path):
    rows = tmp_path / "rows.md"
    empty_run = tmp_path / "run"
    empty_run.mkdir()
    rc = _replay_devices().main(["--device", "cpu", "--samples", "healthy", "--run", f"healthy={empty_run}",
                                 "--rows", str(rows)])
    assert rc == 0
    (row,) = _table(rows.read_text())
    assert row[0] == "replay cpu vs cpu: healthy" and "no snapshot" in row[1] and row[3] == "n/a"


@pytest.mark.slow
def test_replay_devices_replays_a_real_snapshot_twice_and_passes_when_both_answers_agree(tmp_path_factory, tmp_path):
    from tests.sample_runs import sample_run

    run = sample_run(tmp_path_factory, "bf16_nan")
    rows = tmp_path / "rows.md"
    rc = _replay_devices().main(["--device", "cpu", "--samples", "bf16_nan", "--run", f"bf16_nan={run}",
                                 "--rows", str(rows)])
    assert rc == 0
    (row,) = _table(rows.read_text())
    # bf16_nan divides by a zero norm in FP32 as well (samples/bf16_nan.py): the same answer twice.
    assert row[0] == "replay cpu vs cpu: bf16_nan" and row[3] == "PASS"
    assert row[1].startswith("both: numerical_bug aten.div")

"""Every benchmark script under bench/ runs its --quick smoke version to the end.

The numbers a quick run prints mean nothing (docs/benchmarks.md); what this proves is that each
script still works against the current code, so the documented commands can be rerun. A script
that breaks on an internal API change otherwise goes unnoticed until someone measures.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.extras import require

ROOT = Path(__file__).resolve().parents[1]

# script -> a line its quick run prints once it has measured every variant
QUICK = {
    "recorder_overhead.py": "recorder's own time / one _foreach_norm",
    "report_scale.py": "analyzer report --json against the first floor",
    "inspect_throughput.py": "CRC-32 check (inside inspect)",
    "replay_cost.py": "| float16 |",
    "autopsy_time.py": "| autopsy |",
    "fsdp_sync_cost.py": "synced / local",
    "distributed_replay_memory.py": "ratio above the floor: N=2 / N=1",
    "log_parse_time.py": "ratio: t(10 N) / t(N)",
    "spike_false_triggers.py": "all real runs:",
    "fp8_replay_cost.py": "| fp8 diagnosis |",
    "rewind_cost.py": "snapshot file:",
    "fp8_recorder_cost.py": "a sampled step's FP8 statistics",
}
# script -> (module, extra) it needs (require)
NEEDS = {"fp8_replay_cost.py": ("torchao.float8", "fp8"), "fp8_recorder_cost.py": ("torchao.float8", "fp8")}


def test_every_bench_script_with_a_quick_mode_is_listed():
    scripts = {p.name for p in (ROOT / "bench").glob("*.py") if "--quick" in p.read_text()}
    assert scripts == set(QUICK)


def _quick(script: str, tmp_path: Path, *args: str) -> str:
    """stdout of `bench/<script> --quick *args`, run to the end (exit status 0) with TMPDIR in `tmp_path`."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    res = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--quick", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    return res.stdout


@pytest.mark.parametrize("script", sorted(QUICK))
def test_the_bench_script_runs_its_quick_version_to_the_end(script, tmp_path):
    if script in NEEDS:
        require(*NEEDS[script])
    out = _quick(script, tmp_path)
    assert QUICK[script] in out, out[-3000:]


@pytest.mark.parametrize("floor, row", [("apart", "| plain + one _foreach_norm |"), ("beside", None)])
def test_the_recorder_bench_prints_both_floor_ratios_with_either_floor_placement(floor, row, tmp_path):
    out = _quick("recorder_overhead.py", tmp_path, "--floor", floor)
    for kind in ("steps with layer row", "steps with no layer row"):
        assert f"one _foreach_norm of the same gradients, {kind}" in out, out[-3000:]
    # the floor's own variant runs only when the floor is timed apart from the recorder's steps
    assert (row in out) if row else ("| plain + one _foreach_norm |" not in out)


def test_the_inspect_bench_cold_run_compares_the_streamed_inspect_and_both_check_orders_against_a_read(tmp_path):
    out = _quick("inspect_throughput.py", tmp_path, "--cold")
    line = next((ln for ln in out.splitlines() if ln.startswith("vs a read() of the file")), "")
    for name in ("analyzer inspect (cpu) ", "inspect, check first, then scan ", "inspect, check beside the scan "):
        assert name in line, out[-3000:]


def test_the_inspect_bench_pair_run_times_the_pair_scan_alone_beside_inspect(tmp_path):
    out = _quick("inspect_throughput.py", tmp_path, "--pair")
    assert "in 2 file(s)" in out and "scan alone: load(mmap) + scan" in out, out[-3000:]


def test_the_fp8_replay_bench_runs_its_mxfp8_recipe(tmp_path):
    require("torchao.prototype.moe_training", "fp8")
    out = _quick("fp8_replay_cost.py", tmp_path, "--recipe", "mxfp8")
    assert "Linears in mxfp8 FP8" in out and "| fp8 diagnosis |" in out, out[-3000:]

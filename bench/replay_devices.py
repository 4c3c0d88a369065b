"""Each bundled sample's first snapshot, replayed on CUDA and on CPU: same verdict, op, module, phase?

Every ``samples/*.py`` scenario (the files with a ``run`` function) trains on CPU, as it always
does, into ``--work/NAME``; then ``analyzer replay SNAPSHOT --json`` runs on its first snapshot
once with ``--device cpu`` and once with ``--device DEVICE`` (cuda by default). Both answers are
printed side by side. They may legitimately differ: CUDA autocast runs softmax, log_softmax and
layer_norm in FP32 where CPU autocast keeps FP16, so a row that differs is a finding to read,
not necessarily a bug. Samples run side by side (one thread per process): each trains, then
replays on cpu, then on DEVICE.

    python bench/replay_devices.py                          # every sample, cuda against cpu
    python bench/replay_devices.py --samples bf16_nan,healthy
    python bench/replay_devices.py --run bf16_nan=RUN_DIR   # replay an existing run, train nothing
    python bench/replay_devices.py --dry-run                # list the commands, run nothing

``--rows FILE`` appends one row per sample (check | measured | target | result) to FILE, for
``bench/gpu_check.sh``'s table. It exits 0 once every sample has a row (a mismatch or a failed
replay is a FAIL row, not a crash; a run with no snapshot, such as stalled_layers', is n/a);
2 on bad options.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
__all__ = ["discover_samples", "summarize", "main"]

# stalled_layers and loss_outside_autocast never fail, by design: report-only diagnoses.
NO_SNAPSHOT = "the run wrote no snapshot: nothing to replay"
_DEADLINE = [float("inf")]  # time.monotonic() by which every process must be done (--budget)


def discover_samples(root: Path = ROOT) -> list[str]:
    """The scenario modules under ``samples/``: public files that define ``def run(``."""
    return sorted(p.stem for p in (root / "samples").glob("*.py")
                  if not p.stem.startswith("_") and "\ndef run(" in p.read_text(encoding="utf-8"))


def _analyzer() -> list[str]:
    """The ``analyzer`` command of this interpreter's environment (as its console script runs it)."""
    return [sys.executable, "-c", "from analyzer.cli import main; main(prog_name=\"analyzer\")"]


def _env() -> dict[str, str]:
    # One thread per process: the processes run side by side, and the test suite replays that way too.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _train_cmd(name: str, out: Path) -> list[str]:
    return [sys.executable, "-m", f"samples.{name}", "--out", str(out), "--quiet"]


def _replay_cmd(snapshot: Path | str, device: str) -> list[str]:
    return [*_analyzer(), "replay", str(snapshot), "--device", device, "--json"]


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return (lines[-1] if lines else "no output")[:160]


def _run(cmd: list[str], timeout: float) -> tuple[int, str, str]:
    timeout = min(timeout, _DEADLINE[0] - time.monotonic())
    if timeout <= 0:
        return 124, "", "not started: the --budget was spent"
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env())
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout:.0f} s"
    return p.returncode, p.stdout, p.stderr


def summarize(answer: dict) -> dict:
    """verdict, op, module, phase of a replay's JSON answer (None where it names no culprit)."""
    culprit = answer.get("culprit") or {}
    return {"verdict": answer.get("verdict"), "op": culprit.get("op"),
            "module": culprit.get("module"), "phase": culprit.get("phase")}


def _replay(snapshot: Path, device: str, timeout: float) -> dict | str:
    rc, out, err = _run(_replay_cmd(snapshot, device), timeout)
    if rc != 0:
        return f"replay --device {device} exited {rc}: {_last_line(err or out)}"
    try:
        return summarize(json.loads(out))
    except (json.JSONDecodeError, AttributeError) as e:
        return f"replay --device {device} printed no JSON object ({e})"


def _show(s: dict | str) -> str:
    if isinstance(s, str):
        return s
    return f"{s['verdict']} {s['op']} in {s['module']} ({s['phase']})" if s["op"] else f"{s['verdict']} (no culprit)"


def _row(name: str, device: str, base: dict | str, other: dict | str) -> str:
    same = isinstance(base, dict) and isinstance(other, dict) and base == other
    if base == NO_SNAPSHOT:
        return f"| replay {device} vs cpu: {name} | {NO_SNAPSHOT} | same verdict, op, module, phase | n/a |"
    measured = f"both: {_show(base)}" if same else f"cpu: {_show(base)}; {device}: {_show(other)}"
    measured = measured.replace("|", "/").replace("<", "&lt;").replace(">", "&gt;")  # <loss_fn> is no HTML tag
    return f"| replay {device} vs cpu: {name} | {measured} | same verdict, op, module, phase | " \
           f"{'PASS' if same else 'FAIL'} |"


def _snapshot_of(run_dir: Path) -> Path | None:
    snaps = sorted((run_dir / "snapshots").glob("*.pt"))
    return snaps[0] if snaps else None


def _one(name: str, run_dir: Path, train: bool, device: str, timeout: float) -> tuple[str, dict | str, dict | str]:
    if train:
        rc, out, err = _run(_train_cmd(name, run_dir), timeout)
        if rc != 0:
            msg = f"training exited {rc}: {_last_line(err or out)}"
            return name, msg, msg
    snap = _snapshot_of(run_dir)
    if snap is None:
        return name, NO_SNAPSHOT, NO_SNAPSHOT
    base = _replay(snap, "cpu", timeout)
    return name, base, _replay(snap, device, timeout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="the device compared with cpu (default cuda; cpu checks the plumbing)")
    ap.add_argument("--samples", default=None, help="comma-separated scenario names (default: every sample)")
    ap.add_argument("--run", action="append", default=[], metavar="NAME=RUN_DIR",
                    help="use this existing run directory for NAME instead of training it (repeatable)")
    ap.add_argument("--work", default=None, help="folder the trainings write (default: a temporary one)")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="processes side by side")
    ap.add_argument("--timeout", type=float, default=150, help="seconds per training or replay process")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run: later processes get what is left, so every sample "
                         "still gets its row before a caller's timeout (default: no limit)")
    ap.add_argument("--rows", metavar="FILE", default=None, help="append one Markdown row per sample to FILE")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    known = discover_samples()
    names = args.samples.split(",") if args.samples else known
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"unknown sample(s) {', '.join(unknown)}; the samples are {', '.join(known)}")
    given = dict(r.split("=", 1) for r in args.run if "=" in r)
    if len(given) != len(args.run):
        ap.error("--run takes NAME=RUN_DIR")
    if args.budget is not None:
        _DEADLINE[0] = time.monotonic() + args.budget
    with tempfile.TemporaryDirectory(prefix="amp-autopsy-replay-devices-") as tmp:
        work = Path(args.work or tmp)
        runs = {n: (Path(given[n]) if n in given else work / n) for n in names}
        if args.dry_run:
            for n in names:
                if n not in given:
                    print(shlex.join(_train_cmd(n, runs[n])))
                for dev in ("cpu", args.device):
                    print(shlex.join(_replay_cmd(runs[n] / "snapshots" / "<first snapshot>", dev)))
            return 0
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results = list(pool.map(lambda n: _one(n, runs[n], n not in given, args.device, args.timeout), names))
    print(f"| sample | cpu replay | {args.device} replay | same |")
    print("|---|---|---|---|")
    rows = []
    for name, base, other in results:
        same = "n/a" if base == NO_SNAPSHOT else "yes" if isinstance(base, dict) and base == other else "NO"
        print(f"| {name} | {_show(base)} | {_show(other)} | {same} |")
        rows.append(_row(name, args.device, base, other))
    if args.rows:
        with open(args.rows, "a", encoding="utf-8") as f:
            f.writelines(r + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long ``analyzer report`` takes on one hostile line per log format, and how that time grows.

For each format, a log whose one long line holds N characters of what made the old parsers
quadratic or backtracking (repeated CSV header columns, spaces inside a DeepSpeed overflow line or
a Megatron field, digits, a long JSONL value), at N = 10^5 and N = 10^6, timed in-process with
``build_report`` (the imports are paid once, before the first round). The rounds alternate the two
sizes; the script prints each size's median time and the median of the per-round ratios
t(10^6) / t(10^5): about 10 is linear; 100 would be quadratic.

Usage:
    python bench/log_parse_time.py              # 5 rounds
    python bench/log_parse_time.py --repeats 9
    python bench/log_parse_time.py --quick      # N = 10^3 and 10^4, one round: a smoke run
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analyzer.errors import AnalyzerError  # noqa: E402
from analyzer.report import build_report  # noqa: E402

_DS = "steps: 1 loss: 2.0\n[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: x{}\nsteps: 3 loss: 1.0\n"


def _inputs(n: int) -> dict[str, tuple[str, str]]:
    """format -> (file name, text) with a line of about `n` characters."""
    cols = n // 6
    return {
        "csv header, repeated columns": ("metrics.csv", ",".join(["step", "loss"] + [f"c{i % 1000}" for i in range(cols)])
                                         + "\n1,2.0\n2,1.5\n"),
        "deepspeed overflow, spaces": ("ds.log", _DS.format(" " * n)),
        "deepspeed overflow, digits": ("ds.log", _DS.format("9" * n)),
        "megatron field, spaces": ("meg.log", f"iteration 1/ 10 | lm loss: 2.0 | a{' ' * n}b |\n"),
        "megatron iteration, digits": ("meg.log", f"iteration {'1' * n}/ 10 | lm loss: 2.0 |\n"),
        "jsonl value, spaces": ("log.jsonl", '{"step": 1, "loss": ' + " " * n + '2.0}\n'),
        "hf trainer_state, long key": ("trainer_state.json", json.dumps({"log_history": [
            {"step": 1, "loss": 2.0, "x" * n: 1}, {"step": 2, "loss": 1.0}]})),
    }


def _time(path: Path) -> float:
    t = time.perf_counter()
    try:
        build_report(path, plots=False)
    except AnalyzerError:
        pass  # an Error: line is an answer too
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="N = 10^3 and 10^4, one round")
    args = ap.parse_args()
    sizes = (10**3, 10**4) if args.quick else (10**5, 10**6)
    if args.quick:
        args.repeats = 1
    with tempfile.TemporaryDirectory() as tmp:
        files: dict[tuple[str, int], Path] = {}
        for n in sizes:
            for fmt, (name, text) in _inputs(n).items():
                d = Path(tmp) / f"{n}-{len(files)}"
                d.mkdir()
                (d / name).write_text(text)
                files[(fmt, n)] = d / name
        _time(files[("jsonl value, spaces", sizes[0])])  # imports and first-call costs, not timed
        times: dict[tuple[str, int], list[float]] = {k: [] for k in files}
        for _ in range(args.repeats):
            for fmt in _inputs(1):
                for n in sizes:
                    times[(fmt, n)].append(_time(files[(fmt, n)]))
    print(f"{'input':32} {f't({sizes[0]:.0e}) s':>9} {f't({sizes[1]:.0e}) s':>9} {'ratio':>6}   "
          f"(medians of {args.repeats} rounds; ratio: t(10 N) / t(N), ~10 is linear)")
    for fmt in _inputs(1):
        a, b = times[(fmt, sizes[0])], times[(fmt, sizes[1])]
        ratio = statistics.median(y / x for x, y in zip(a, b))
        print(f"{fmt:32} {statistics.median(a):9.3f} {statistics.median(b):9.3f} {ratio:6.1f}")


if __name__ == "__main__":
    main()

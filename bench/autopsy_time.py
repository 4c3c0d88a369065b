"""Wall time of ``analyzer autopsy`` on the demo run, against one plain replay of the same snapshot.

The cost target: the whole autopsy of the demo run (report, snapshot pick, replays, every
fix tried on the culprit) takes under 30 s on this project's 2-core CPU. The script records the
demo scenario once (``samples.fp16_attention_overflow``, the run ``analyzer demo`` trains), then
times, interleaved round by round so that load from other processes hits them alike:

- ``report``: ``build_report`` on the run directory (``analyzer report``'s work);
- ``replay``: one ``replay_snapshot`` of the first snapshot (``analyzer replay``'s work: FP32 and
  the run's precision, forward and backward);
- ``autopsy``: ``run_autopsy`` end to end (``analyzer autopsy``'s work, without printing).

The table gives the median of each, and the median per-round ratio to the replay: what the
autopsy costs in units of the command a user ran by hand before it existed.

``--compiled`` times the extra cost of a compiled snapshot instead: a ``torch.compile``'d
(Inductor) FP16 model whose compiled step alone is NaN (``tests/analyzer/replay/compile_models.py``),
replayed with its compiled run, the module search and the ``compile_disable`` fix, against the
same snapshot's eager replay. Round 1 compiles with an empty Inductor cache (a first replay on a
machine), later rounds reuse it.

Usage::

    python bench/autopsy_time.py            # 3 rounds
    python bench/autopsy_time.py --quick    # 1 round: a smoke run
    python bench/autopsy_time.py --compiled # the compiled snapshot's extra replay time
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analyzer.autopsy import run_autopsy  # noqa: E402  (at the top: --help proves every import works)
from analyzer.replay import replay_snapshot  # noqa: E402
from analyzer.report import build_report  # noqa: E402
from recorders import imports, schema  # noqa: E402

TARGET_S = 30.0  # the whole autopsy of the demo run under 30 s on this CPU
SCENARIO = "fp16_attention_overflow"


def _record(out: Path, scenario: str) -> tuple[Path, float]:
    import importlib

    from analyzer.load import samples_package, samples_roots

    with imports.import_roots(samples_roots()):
        module = importlib.import_module(f"{samples_package()}.{scenario}")
    t0 = time.perf_counter()
    run_dir = Path(module.run(out / scenario))
    return run_dir, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; --quick: 1)")
    ap.add_argument("--scenario", default=SCENARIO, help=f"sample scenario to record (default {SCENARIO})")
    ap.add_argument("--compiled", action="store_true", help="time a compiled snapshot's extra replay cost")
    args = ap.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    if args.compiled:
        return _compiled(rounds)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, train_s = _record(Path(tmp), args.scenario)
        snaps = sorted(p for p in (run_dir / schema.SNAPSHOT_DIR).iterdir() if schema.SNAPSHOT_RE.match(p.name))
        if not snaps:
            ap.error(f"the {args.scenario} run wrote no snapshot: nothing to replay")
        first = str(snaps[0])
        times: dict[str, list[float]] = {"report": [], "replay": [], "autopsy": []}
        last = None
        for _ in range(rounds):
            for name in times:
                t0 = time.perf_counter()
                if name == "report":
                    build_report(run_dir)
                elif name == "replay":
                    replay_snapshot(first, device="cpu")
                else:
                    last = run_autopsy(run_dir, device="cpu")
                times[name].append(time.perf_counter() - t0)
    tried = sum(f.status != "not_tried" for _, f in last.fixes)
    print(f"run: {args.scenario} ({len(snaps)} snapshot(s); recorded in {train_s:.1f} s), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, CPU kernels {torch.backends.cpu.get_cpu_capability()}, "
          f"{rounds} interleaved round(s)")
    print(f"autopsy: verdict {last.verdict}, {len(last.replays)} replay(s), {tried} fix(es) tried "
          f"({sum(f.status == 'verified' for _, f in last.fixes)} verified), "
          f"{len(last.shared)} replay(s) sharing an earlier culprit's fixes")
    print()
    print("| stage | median wall time | / one replay |")
    print("|---|---|---|")
    for name in times:
        ratio = statistics.median(a / b for a, b in zip(times[name], times["replay"]))
        print(f"| {name} | {statistics.median(times[name]):.2f} s | {ratio:.2f}x |")
    med = statistics.median(times["autopsy"])
    print(f"| target: autopsy of the demo run | < {TARGET_S:.0f} s | {'PASS' if med < TARGET_S else 'FAIL'} |")


def _compiled(rounds: int) -> None:
    """The compiled-only NaN's snapshot: eager replay vs replay with the compiled run, and its fix."""
    import dataclasses
    import os

    from analyzer.replay import Replay
    from recorders import Recorder
    from tests.analyzer.replay.compile_models import build_gate_net, gate_batch, mse_loss

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")  # round 1 compiles from nothing
        model, batch = torch.compile(build_gate_net()), gate_batch()
        ref = "tests.analyzer.replay.compile_models"
        scaler = torch.amp.GradScaler("cpu")
        t0 = time.perf_counter()
        with Recorder(Path(tmp) / "run", model, factory=f"{ref}:build_gate_net", loss_fn=f"{ref}:mse_loss",
                      scaler=scaler, amp_dtype=torch.float16) as rec:
            rec.begin_step(0, batch)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = mse_loss(model, batch)
            scaler.scale(loss).backward()
            rec.end_step(loss)
        train_s = time.perf_counter() - t0
        snap = next((Path(tmp) / "run" / schema.SNAPSHOT_DIR).glob("*.pt"))
        times: dict[str, list[float]] = {"eager replay": [], "replay with the compiled run": [], "fixes": []}
        for _ in range(rounds):
            eager = Replay(snap)
            eager.snapshot = dataclasses.replace(eager.snapshot, compile=None)  # the same snapshot, replayed eager
            t0 = time.perf_counter()
            eager.run()
            times["eager replay"].append(time.perf_counter() - t0)
            replay = Replay(snap)
            t0 = time.perf_counter()
            result = replay.run()
            times["replay with the compiled run"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            fixes = replay.try_fixes(result)
            times["fixes"].append(time.perf_counter() - t0)
    cmp = result.compiled
    print(f"compiled snapshot: training step {train_s:.1f} s (first compile), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, CPU kernels {torch.backends.cpu.get_cpu_capability()}, {rounds} round(s)")
    print(f"verdict {result.verdict}, module {cmp.get('module')!r}, {1 + len(cmp.get('tried', []))} compiled run(s); "
          f"fixes {[(f.name, f.status) for f in fixes]}")
    print()
    print("| stage | round 1 (empty Inductor cache) | median of later rounds |")
    print("|---|---|---|")
    for name, ts in times.items():
        later = f"{statistics.median(ts[1:]):.2f} s" if len(ts) > 1 else "-"
        print(f"| {name} | {ts[0]:.2f} s | {later} |")


if __name__ == "__main__":
    main()

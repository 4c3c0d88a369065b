"""Record real 2-rank FSDP2 runs (gloo, CPU) with a fault at a known step on one rank.

One spawn of two processes trains, in one process group and in this order (``RUNS``):

- ``plain``: no Recorder (the numerics every recorded run must reproduce);
- ``synced``: a Recorder with ``sync_failures=True``: every rank snapshots the failing step
  together, the weights go into one DCP directory; it also gathers the whole-parameter
  gradient and weight norms each step (``ref_grad_norms``/``ref_param_norms``), the truth the
  report's merged shard statistics must equal;
- ``local``: ``sync_failures=False``: each failing rank writes its own shards, no collective;
- ``batch_nan``: ``sync_failures=True``, the fault is a NaN in rank ``FAULT_RANK``'s batch instead:
  only its loss fails, the reduce-scatter spreads NaN gradients to the other rank (which fails
  for ``nonfinite_grads``), and the one DCP directory is named after ``nonfinite_loss``;
- ``batch_nan_local``: like ``batch_nan`` but ``sync_failures=False``, as most runs are recorded:
  each rank writes its own shards under its own reason (``nonfinite_loss`` on the fault rank,
  ``nonfinite_grads`` on the other);
- ``uneven``: like ``batch_nan``, but rank 0 may take no snapshot (``max_snapshots=0``): the
  ranks do not all snapshot, so the fault rank writes its local shards, with no collective;
- ``killed``: like ``synced``, but the fault rank SIGKILLs itself at ``KILL_STEP`` (mid-step,
  no flush); the other rank errors out at its next collective.

The fault (``FAULT``): before step ``FAULT_STEP``'s forward, rank ``FAULT_RANK`` writes inf into
its shard of ``FAULT_PARAM`` (its local element ``[0, 3]``, the whole tensor's ``[4, 3]``),
as a corrupted optimizer update on that rank would. The forward all-gathers it, so every rank's
loss is inf at that step: only the shard statistics say which rank's weights went bad.

The model is ``tests.dist_worker:build_model`` (Linear(8, 8), ReLU, Linear(8, 1)) under
``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``;
the loss ``tests.dist_worker:fsdp_loss``.

Example (a pytest fixture; ~15 s on two cores):
    >>> runs = record_fsdp_runs(tmp_path)           # doctest: +SKIP
    >>> runs.dirs["synced"] / "snapshots"           # doctest: +SKIP
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


from . import dist_worker
from ._spawn import spawn_ranks

__all__ = ["WORLD", "STEPS", "FAULT_RANK", "FAULT_STEP", "FAULT_PARAM", "FAULT_GLOBAL_INDEX", "KILL_STEP",
           "FAULT", "RUNS", "FsdpRuns", "record_fsdp_runs", "shared_fsdp_runs", "fsdp_available"]

WORLD, STEPS = 2, 5
FAULT_RANK, FAULT_STEP, FAULT_PARAM = 1, 2, "0.weight"
FAULT_GLOBAL_INDEX = (4, 3)  # rank 1 holds rows 4..7 of the [8, 8] weight: its local [0, 3]
KILL_STEP = 4
FAULT = {"rank": FAULT_RANK, "step": FAULT_STEP, "param": FAULT_PARAM, "local_index": [0, 3]}
RUNS = ("plain", "synced", "local", "batch_nan", "batch_nan_local", "uneven", "killed")


def fsdp_available() -> bool:
    """fully_shard and DCP importable, gloo available, not Windows."""
    import sys

    import torch.distributed as dist

    try:
        import torch.distributed.checkpoint  # noqa: F401
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
    except ImportError:
        return False
    return dist.is_available() and dist.is_gloo_available() and sys.platform != "win32"


@dataclass(frozen=True)
class FsdpRuns:
    """The recorded runs: ``dirs[name]`` (run directories, None for ``plain``) and what each rank saw
    (``results[rank][name]``: losses, failures, snapshots, weights, reference norms; ``"warnings"``)."""

    root: Path
    dirs: dict[str, Path | None]
    results: dict[int, dict]


def record_fsdp_runs(root: str | Path, timeout_s: float = 240.0) -> FsdpRuns:
    """Train ``RUNS`` on two processes under `root` and return where they are.

    Raises RuntimeError when the ranks do not finish within `timeout_s` or a rank other than the
    killed one fails.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)  # the file rendezvous below needs the directory to exist
    dirs = {name: (None if name == "plain" else root / name) for name in RUNS}
    specs = {
        "plain": {"run_dir": None},
        "synced": {"run_dir": str(dirs["synced"]), "sync": True, "reference": True},
        "local": {"run_dir": str(dirs["local"]), "sync": False},
        "batch_nan": {"run_dir": str(dirs["batch_nan"]), "sync": True, "batch_nan": True},
        "batch_nan_local": {"run_dir": str(dirs["batch_nan_local"]), "sync": False, "batch_nan": True},
        "uneven": {"run_dir": str(dirs["uneven"]), "sync": True, "batch_nan": True, "max_snapshots": {"0": 0}},
        "killed": {"run_dir": str(dirs["killed"]), "sync": True, "kill_step": KILL_STEP},
    }
    # NB: spawn, not fork: forked children hung in gloo after other tests had run in the parent.
    codes = spawn_ranks(dist_worker.train_fsdp_rank,
                        (WORLD, f"file://{root}/rendezvous", specs, STEPS, FAULT, str(root)), WORLD, timeout_s)
    # the fault rank was SIGKILLed in the last run (exit code -9); every other rank exits 0
    if any(c != 0 for r, c in enumerate(codes) if r != FAULT_RANK) or codes[FAULT_RANK] not in (0, -9):
        raise RuntimeError(f"FSDP2 ranks exited with codes {codes}")
    results = {r: json.loads((root / f"rank{r}.json").read_text()) for r in range(WORLD)}
    return FsdpRuns(root=root, dirs=dirs, results=results)


_RECORDED: dict[str, FsdpRuns] = {}


def shared_fsdp_runs(tmp_path_factory) -> FsdpRuns:
    """``record_fsdp_runs`` once per pytest session, for every test module that needs the runs
    (``tmp_path_factory``: pytest's session fixture). Tests only read the runs: never modify them."""
    if "runs" not in _RECORDED:
        _RECORDED["runs"] = record_fsdp_runs(tmp_path_factory.mktemp("fsdp"))
    return _RECORDED["runs"]

"""``spawn_ranks``: train on N spawned processes, waiting at most a timeout (a hung gloo rank never hangs the suite)."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch.multiprocessing as mp

__all__ = ["spawn_ranks"]


def spawn_ranks(fn: Callable, args: tuple, nprocs: int, timeout_s: float) -> list[int]:
    """Run ``fn(rank, *args)`` on `nprocs` spawned processes and return their exit codes.

    Raises RuntimeError (after killing every process) when they do not all finish within `timeout_s`.
    """
    ctx = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in ctx.processes):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            raise RuntimeError(f"the {nprocs} ranks did not finish in {timeout_s:.0f} s")
        time.sleep(0.2)
    return [p.exitcode for p in ctx.processes]

"""The process group of a distributed replay: one per torchrun launch, a timeout on every collective.

Each rank's work comes in phases; a phase ends in ``DistGroup.agree``, an all-gather of small host
values in which a rank that failed sends its error instead. Every rank then raises the lowest failing
rank's error, so one ``Error:`` line comes out of rank 0 and every process exits. A rank that dies or
stops answering makes its peers' next collective fail (gloo: at once; any backend: at the timeout),
which becomes the same one error.
"""
from __future__ import annotations

import os
import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ...errors import AnalyzerError

__all__ = ["DistGroup", "TIMEOUT_ENV", "DEFAULT_TIMEOUT_S", "RankFailed"]

TIMEOUT_ENV = "AMP_AUTOPSY_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0


class RankFailed(AnalyzerError):
    """A rank of the distributed replay failed, died or timed out; the message names the rank."""


def _timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e6:
        raise AnalyzerError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds", fix=f"set {TIMEOUT_ENV} to e.g. 120")
    return value


class DistGroup:
    """The replay's process group (gloo on CPU, NCCL with CUDA), entered once per process.

    Attributes:
        rank, world_size: this process's rank and the launch's rank count.
        device: where this rank replays (``cuda:LOCAL_RANK`` under NCCL).
        timeout_s: every collective's timeout (``AMP_AUTOPSY_DIST_TIMEOUT``, default 300 s).
    """

    def __init__(self, device: str = "auto"):
        self.timeout_s = _timeout_s()
        cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
        if cuda and not torch.cuda.is_available():
            raise AnalyzerError("--device cuda was asked for but CUDA is not available here", fix="use --device cpu")
        self.backend = "nccl" if cuda else "gloo"
        local = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cuda", local) if cuda else torch.device("cpu")
        self.rank, self.world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self._broken = False

    def __enter__(self) -> DistGroup:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            dist.init_process_group(self.backend, timeout=timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - a rendezvous that failed or timed out
            raise RankFailed(f"the {self.world_size} replay processes could not form a process group "
                             f"({type(e).__name__}: {str(e).strip()[:160]})",
                             fix="check torchrun's rendezvous flags (--rdzv-endpoint, --nnodes) and that every "
                                 "node started") from e
        return self

    def __exit__(self, *exc) -> None:
        if dist.is_initialized() and not self._broken:
            if exc[0] is None:
                # NB: every rank done with the last collective before any closes its connections: a rank that
                # tore the group down while a peer still sent to it made that peer's gloo thread abort
                self.settle()
            if not self._broken:
                dist.destroy_process_group()

    def agree(self, value: Any = None, error: AnalyzerError | None = None) -> list[Any]:
        """Every rank's `value`; raises on every rank the lowest rank's `error` when any rank sent one.

        NB: a collective: every rank must call it the same number of times.
        """
        mine = ("error", str(error)) if error is not None else ("ok", value)
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, mine)
        except Exception as e:  # noqa: BLE001 - a peer died (gloo: connection closed) or the timeout ran out
            raise self.broken(e) from e
        for rank, (kind, payload) in enumerate(out):
            if kind == "error":
                raise RankFailed(payload if rank == self.rank else f"rank {rank}: {payload}")
        return [payload for _, payload in out]

    def share(self, value: Any, src: int) -> Any:
        """Rank `src`'s `value` on every rank (a broadcast of one picklable object).

        NB: a collective: every rank must call it the same number of times, with the same `src`.
        """
        payload, error = None, None
        if self.rank == src:
            try:
                payload = pickle.dumps(value)
            except Exception as e:  # noqa: BLE001 - a value that cannot cross processes: every rank stops on it
                error = AnalyzerError(f"rank {src} cannot send its {type(value).__name__} to the other ranks "
                                      f"({type(e).__name__}: {str(e)[:120]})",
                                      fix="please report this with the snapshot")
        self.agree(None, error)  # NB: the source's failure raised on every rank, before any waits on the broadcast
        box = [payload]
        try:
            dist.broadcast_object_list(box, src=src)
        except Exception as e:  # noqa: BLE001 - a peer died or the timeout ran out
            raise self.broken(e) from e
        return pickle.loads(box[0])  # NB: bytes this launch's own rank pickled a moment ago

    def settle(self) -> None:
        """A last barrier before the processes leave with an error (skipped once a collective has failed)."""
        if self._broken:
            return
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - a peer gone meanwhile: nothing left to wait for
            self._broken = True

    def broken(self, e: BaseException) -> RankFailed:
        """The error a failed collective becomes: a peer died, or did not answer within the timeout."""
        self._broken = True
        return RankFailed(f"a collective of the distributed replay failed on rank {self.rank}: a peer rank died or "
                          f"did not answer within {self.timeout_s:g} s ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:160]})",
                          fix="see the other ranks' exit status (torchrun prints it); free memory on that node, or "
                              f"raise {TIMEOUT_ENV} for a slow step")

"""``replay`` and ``autopsy`` under torchrun: every rank replays its shards; rank 0 prints, the others print nothing.

``cli`` calls ``distributed_command`` when ``_torchrun.under_torchrun()``; the replay itself is
``replay.distributed.distributed_replay``. An error every rank stops on is printed once, by rank 0, as one
``Error:`` line while the other ranks still wait (torchrun stops every process once one exits with an error),
and every process exits 1.
"""
from __future__ import annotations

import os
import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import click

from ._cli_errors import one_line
from ._terminal import escape_controls
from .errors import AnalyzerError, BadInputError

__all__ = ["distributed_command", "first_failing_snapshot"]


def first_failing_snapshot(run: str) -> Path:
    """``autopsy``'s pick under torchrun: the earliest failing snapshot of RUN (then the lowest rank).

    Every rank reads the same directory and so picks the same file.
    """
    from recorders import schema

    from .autopsy.pick import pick_snapshots
    from .load import snapshot_info

    folder = Path(run) / schema.SNAPSHOT_DIR
    if not folder.is_dir():
        raise BadInputError("not a run directory with a snapshots/ folder", path=run,
                            fix="pass the run directory the Recorder wrote (or a snapshot to analyzer replay)")
    infos = [snapshot_info(p) for p in sorted(folder.iterdir()) if p.is_file() and schema.SNAPSHOT_RE.match(p.name)]
    picked = pick_snapshots(infos)
    if not picked:
        raise BadInputError("the run has no snapshot of a failing step to replay", path=folder,
                            fix="run analyzer report on it, without torchrun")
    return Path(picked[0].file)


def distributed_command(target: str, print_json: Callable[[dict], None] | None, *, unsupported: dict,
                        dtypes: str | None = None, autopsy: bool = False, **kw) -> None:
    """Replay `target` (a snapshot; with `autopsy`, a run directory's first failing snapshot) on every rank.

    `print_json`: ``--json``'s printer (None: the text answer).
    """
    from .render.distributed import render_distributed_text
    from .replay.distributed import distributed_replay

    given = [k for k, v in unsupported.items() if v is not None]
    if given:
        raise click.UsageError(f"{', '.join(given)} not supported under torchrun: every rank replays its own "
                               "recorded shards and batch")
    rank0 = os.environ.get("RANK", "0") == "0"
    if not rank0:
        warnings.simplefilter("ignore")  # only rank 0 prints, warnings included
    dtype_list = None if dtypes is None else [d.strip() for d in dtypes.split(",") if d.strip()]

    def report(e: Exception) -> None:  # rank 0, while its peers wait
        click.echo(f"Error: {one_line(str(e))}", err=True)

    if rank0:
        # NB: torchrun SIGTERMs every rank once one exits; a peer that died while rank 0 was still computing (not
        # yet waiting in a collective, whose failure would say so) would otherwise end rank 0 without a word
        signal.signal(signal.SIGTERM, lambda *_: (report(_STOPPED), _leave(1)))
    try:
        snapshot = first_failing_snapshot(target) if autopsy else target
        result = distributed_replay(snapshot, dtypes=dtype_list, on_error=report, **kw)
    except AnalyzerError as e:
        if autopsy and rank0 and "snapshot" not in locals():
            report(e)  # the pick failed before any process group: the same on every rank
        _leave(1)  # reported once, on rank 0
    except Exception:
        if rank0:
            raise
        _leave(1)  # rank 0 prints the one Error: line
    if result is None:
        _leave(0)
    if print_json is not None:
        print_json(dict(result.to_dict(), **({"autopsy_snapshot": str(snapshot)} if autopsy else {})))
    else:
        if autopsy:
            click.echo(escape_controls(f"autopsy under torchrun: the run's first failing snapshot, {snapshot}\n"))
        click.echo(escape_controls(render_distributed_text(result)))
    _leave(0)


_STOPPED = AnalyzerError("rank 0 was stopped (SIGTERM) before the replay ended: torchrun stops every rank once one "
                         "exits, so a peer rank died or failed first (or the job was terminated)",
                         fix="see the other ranks' exit status, which torchrun prints; free memory on that node")


def _leave(code: int) -> None:
    """Exit now, output flushed, without the interpreter's teardown.

    NB: one rank in ten of the tests' replays aborted at exit ("terminate called without an active
    exception": a C++ thread still joinable while objects holding the process group were destroyed),
    after its answer was complete; an exit without teardown leaves nothing to abort. Warnings held back
    for after the output are not printed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

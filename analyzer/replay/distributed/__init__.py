"""The distributed replay: a sharded (FSDP2) or DDP snapshot's step on N processes under torchrun, collectives included."""
from __future__ import annotations

from .agree import DISTRIBUTED_VERDICTS, Decision, decide, summarize
from .replay import distributed_replay
from .result import DistributedResult

__all__ = ["distributed_replay", "DistributedResult", "DISTRIBUTED_VERDICTS", "Decision", "decide", "summarize"]

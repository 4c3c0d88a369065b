"""Whether this process was started by ``torchrun`` for several ranks (read from the environment; no torch import)."""
from __future__ import annotations

import os

__all__ = ["under_torchrun"]


def under_torchrun() -> bool:
    """``WORLD_SIZE`` above 1 with ``RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set: torchrun's environment.

    A single process (``WORLD_SIZE`` 1, or no launcher) replays in one process, as without torchrun.
    """
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    return world > 1 and all(k in os.environ for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"))

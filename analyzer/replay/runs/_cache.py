"""``Memo``: the bounded memo dict behind replay's per-op and per-file lookups.

The hot path asks the same questions of every op (its name, whether it writes or views an
input, which user file called it); the answers never change, so they are memoised. A long-lived
process replaying many snapshots must not grow without bound, so a memo that reaches its limit
is emptied and refilled (the answers are cheap to recompute; an LRU's bookkeeping is not).
"""
from __future__ import annotations

__all__ = ["Memo"]


class Memo(dict):
    """A dict that empties itself when an insert would take it past `limit` entries.

    Example:
        >>> m = Memo(2); m["a"] = 1; m["b"] = 2; m["c"] = 3
        >>> dict(m)
        {'c': 3}
    """

    def __init__(self, limit: int = 4096) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value) -> None:
        if key not in self and len(self) >= self.limit:
            self.clear()
        super().__setitem__(key, value)

"""Detection: from a replay's precision runs to a ``Diagnosis`` (which op made the first NaN/Inf, and why)."""

"""The values a replay returns: ``ReplayResult``, ``Diagnosis``, the op records and each run's ``RunTrace``."""

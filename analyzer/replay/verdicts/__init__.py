"""The verdicts a replay can reach: the registry (``registry.py``) and the built-in verdicts."""

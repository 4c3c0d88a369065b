"""The fixes a replay tries on the failing step: the registry (``registry.py``), the built-in fixes and their hooks."""

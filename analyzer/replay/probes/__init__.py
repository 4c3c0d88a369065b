"""The evidence a replay gathers around its diagnosis: one module per kind, each a registered probe.

The registry, the order the probes run in and the input they read are ``registry.py``; importing
this package registers the built-in probes (their order is ``registry.ORDER``, not this import list).
"""
from __future__ import annotations

from . import (autocast_off, batch_fault, compiled, fp8, magnitude, micro_batch,  # noqa: F401  (register)
               outside_writes, precision, reproduction, small_input, spike, sqrt_d)
from .registry import ORDER, PROBES, Evidence, Probe, ProbeInput, probe, run_probes, spread

__all__ = ["ORDER", "PROBES", "Evidence", "Probe", "ProbeInput", "probe", "run_probes", "spread"]

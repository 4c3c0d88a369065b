"""Probe ``autocast_off``: the snapshot names an AMP dtype, but the recorder saw autocast off in training.

meta.json's ``autocast`` entry (``enabled: false``) says training's forward ran without autocast,
so the step is replayed as it ran, in FP32 (``_setup.autocast_was_off``); the summary says why.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..runs._setup import autocast_was_off
from .registry import ProbeInput, probe

__all__ = ["AutocastOff", "autocast_off"]


@dataclass(frozen=True)
class AutocastOff:
    """The snapshot's ``amp_dtype`` and what the recorder saw of autocast (meta.json)."""

    amp_dtype: str
    seen: Mapping[str, Any]

    def to_dict(self) -> dict:
        return {"autocast_off": {"amp_dtype": self.amp_dtype, "seen": dict(self.seen)}}

    def note(self) -> str:
        return (f"NB: the snapshot says amp_dtype={self.amp_dtype}, but the recorder saw autocast off on "
                f"{self.seen.get('device_type')} during training's forward (meta.json), so the run trained in FP32 "
                "and the step is replayed as it ran, in FP32.")


@probe("autocast_off")
def autocast_off(inp: ProbeInput) -> AutocastOff | None:
    if inp.snapshot.amp_dtype is None:
        return None
    seen = autocast_was_off(inp.path)
    return None if seen is None else AutocastOff(str(inp.snapshot.amp_dtype), seen)

"""Replay of a torch.compile'd model: names with or without ``_orig_mod.``, and the step compiled as training compiled it.

Snapshots of format version 5 hold the original module's names; older snapshots of a
``torch.compile(model)`` hold ``_orig_mod.fc1.weight``. ``fit_state`` maps either onto the
rebuilt model's own keys, through the names without ``_orig_mod`` segments.
"""
from __future__ import annotations

from typing import Any

import torch

from ...load.compiled import clean_name, strip_orig_mod

__all__ = ["fit_state", "original_module"]


def original_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module behind a factory's ``torch.compile`` wrapper(s): the eager model the replay watches."""
    from recorders.compiled import unwrap

    return unwrap(model)


def fit_state(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` keyed by `model`'s own state_dict keys when the two differ only by ``_orig_mod`` segments, or by
    the ``module.`` prefix of a DDP wrapper the Recorder was given.

    Any other mismatch returns `state` as it is, so ``load_state_dict`` names the real difference.
    """
    own = list(model.state_dict())
    if set(own) == set(state):
        return state
    ddp = "module."  # a Recorder given the DDP wrapper: every name under it
    if state and all(k.startswith(ddp) for k in state) and {k[len(ddp):] for k in state} == set(own):
        return {k[len(ddp):]: v for k, v in state.items()}
    by_clean = {clean_name(k): k for k in own}
    cleaned = strip_orig_mod(state)
    if len(by_clean) != len(own) or set(by_clean) != set(cleaned):
        return state
    return {by_clean[k]: v for k, v in cleaned.items()}

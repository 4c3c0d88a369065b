"""What a checkpoint reader needs from a loaded file: its state_dict, a saved GradScaler scale, small JSON.

Shared by ``adhoc`` (a checkpoint and a batch replayed without a recorder) and its readers of HF
directories (``_hfdir``) and Lightning checkpoints (``_modclass``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInputError
from ._dense import check_dense

__all__ = ["HF_BUILDER", "HF_LOSS", "PL_BUILDER", "PL_LOSS", "STATE_KEYS", "clean_state", "read_json", "state_dict_of"]

STATE_KEYS = ("model", "state_dict", "model_state_dict")
HF_BUILDER = "recorders.integrations.hf:build_pretrained"
HF_LOSS = "recorders.integrations.hf:pretrained_loss"
PL_BUILDER = "recorders.integrations.lightning:build_module"
PL_LOSS = "recorders.integrations.lightning:training_step_loss"
_MAX_JSON = 64 << 20


def state_dict_of(obj: Any, p: Path) -> tuple[dict, str | None]:
    """The name -> tensor dict in a loaded file: the file itself, or under a common key (and which)."""
    if _is_state(obj):
        return obj, None
    if isinstance(obj, dict):
        for key in STATE_KEYS:
            if _is_state(obj.get(key)):
                return obj[key], key
    keys = sorted(map(str, obj))[:8] if isinstance(obj, dict) else None
    raise BadInputError(
        "holds no state_dict: no dict of name -> tensor at the top or under "
        f"{', '.join(repr(k) for k in STATE_KEYS)}" + (f" (keys: {keys})" if keys is not None
                                                       else f" (a {type(obj).__name__})"),
        path=p, fix="pass model.state_dict() saved with torch.save, a .safetensors file, an HF checkpoint "
                    "directory or a Lightning .ckpt")


def _is_state(d: Any) -> bool:
    return isinstance(d, dict) and bool(d) and all(isinstance(k, str) for k in d) and \
        all(isinstance(v, torch.Tensor) for v in d.values())


def clean_state(state: dict, p: Path) -> tuple[dict, list[str]]:
    """Dense tensors only; a prefix every key shares from torch.compile or DDP (``_orig_mod.``, ``module.``) dropped."""
    for name, t in state.items():
        check_dense(t, path=p, where=f"state_dict[{name!r}]")
    notes = []
    for prefix in ("_orig_mod.", "module."):
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
            notes.append(f"the prefix {prefix!r} every key had (torch.compile / DDP) was dropped")
    return dict(state), notes


def _int_of(obj: dict, keys) -> int | None:
    for k in keys:
        v = obj.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63:
            return v
    return None


def _scaler_scale(obj: dict) -> float | None:
    """A GradScaler ``state_dict()``'s scale saved beside the weights (``scaler``, Lightning's ``MixedPrecision``)."""
    for key in ("scaler", "grad_scaler", "scaler_state", "MixedPrecision", "native_amp_scaling_state"):
        s = obj.get(key)
        v = s.get("scale") if isinstance(s, dict) else None
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = float(v)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
            return float(v)
    return None


def read_json(p: Path) -> Any:
    """A small JSON file (config.json, trainer_state.json, a shard index), one BadInputError if not."""
    try:
        if p.stat().st_size > _MAX_JSON:
            raise BadInputError(f"is larger than {_MAX_JSON >> 20} MiB, too large for this JSON file", path=p)
        return json.loads(p.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BadInputError(f"not valid JSON ({' '.join(str(e).split())[:160]})", path=p,
                            fix="pass the directory save_pretrained or the HF Trainer wrote") from e

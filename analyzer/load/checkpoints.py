"""``load_checkpoint``: one checkpoint file (``checkpoint``) or an HF Trainer ``checkpoint-N/`` directory (``hf_checkpoint``)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import BadInputError
from .checkpoint import Checkpoint, load_checkpoint_file
from .hf_checkpoint import is_hf_checkpoint_dir, load_hf_checkpoint

__all__ = ["load_checkpoint"]


def load_checkpoint(path: str | os.PathLike, *, defer_crc: bool = False, stream: bool = False,
                    beside: Any = None) -> Checkpoint:
    """Open `path` and list its tensors by role. Raises BadInputError / VersionError with a fix.

    `defer_crc`: a checkpoint file's CRC-32 check runs beside the caller's reads; call
    ``ckpt.verify()`` before reporting anything (``load_checkpoint_file``, also for `stream` and
    `beside`). Directories load checked.

    Example:
        >>> ckpt = load_checkpoint("ckpt.pt")  # doctest: +SKIP
        >>> [(e.name, e.role) for e in ckpt.entries][:2]  # doctest: +SKIP
        [('model.fc.weight', 'weight'), ('model.fc.bias', 'weight')]
    """
    path = Path(path)
    if path.is_dir():
        if is_hf_checkpoint_dir(path):
            return load_hf_checkpoint(path)
        raise BadInputError("is a directory without model.safetensors, pytorch_model.bin or optimizer.pt",
                            path=path, fix="pass an HF checkpoint-N/ directory or one checkpoint file")
    return load_checkpoint_file(path, defer_crc=defer_crc, stream=stream, beside=beside)

"""One check every reader of tensors from a file makes: a tensor holds the elements it declares."""
from __future__ import annotations

import os

import torch

from ..errors import BadInputError

__all__ = ["check_dense"]

_REFIX = "the snapshot is damaged or was not written by the amp-autopsy Recorder; re-record the run"


def check_dense(t: torch.Tensor, *, path: str | os.PathLike, where: str) -> None:
    """Refuse a tensor that declares more elements than its storage holds (an expanded view)."""
    if t.layout != torch.strided:
        raise BadInputError(f"{where} is a {t.layout} tensor; snapshots hold dense (strided) tensors",
                            path=path, fix=_REFIX)
    nbytes = t.untyped_storage().nbytes()
    need = t.numel() * t.element_size()
    if need > nbytes:
        raise BadInputError(
            f"{where} declares {t.numel()} elements ({need} bytes) over {nbytes} bytes of storage "
            "(an expanded or stride-0 view); refusing to materialise it",
            path=path, fix="snapshots hold dense tensors; save batch tensors with .contiguous()")

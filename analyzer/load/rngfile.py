"""The RNG state of a failing step, for runs without a recorder: ``--rng FILE`` and a batch file's ``rng`` entry.

One format, the recorder snapshot's ``rng`` key (``recorders.schema.SNAPSHOT_KEYS``), and one reader
(``check_rng_state``, which also checks every snapshot's): ``{"cpu": torch.get_rng_state(), "cuda":
torch.cuda.get_rng_state_all() or None}``. Saved at the start of the step, before anything draws,
it lets replay draw what the failing step drew (dropout masks, a noise level drawn inside the loss)::

    rng = {"cpu": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    loss = loss_fn(model, batch)
    if not torch.isfinite(loss):
        torch.save({"batch": batch, "rng": rng}, "batch.pt")   # or torch.save(rng, "rng.pt") beside it

A bare CPU state (``torch.save(torch.get_rng_state(), "rng.pt")``) is read as ``{"cpu": it, "cuda": None}``.
Files are read with ``weights_only`` (``torchfile.torch_load_safe``); anything else is one ``BadInputError``.

Example:
    >>> rng = load_rng_file("rng.pt")  # doctest: +SKIP
    >>> sorted(rng), rng["cpu"].dtype  # doctest: +SKIP
    (['cpu', 'cuda'], torch.uint8)
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import BadInputError
from ._dense import check_dense

__all__ = ["MAX_RNG_FILE", "RNG_RECIPE", "check_rng_state", "load_rng_file", "split_batch_rng"]

MAX_RNG_FILE = 16 * 2**20  # a CPU state is 5056 bytes and a CUDA one 16: a bigger file is no RNG state
_MAX_DEVICES = 4096
_MAX_CUDA_BYTES = 2**16  # per device (Philox: seed and offset, 16 bytes)
RNG_RECIPE = ("save the state at the start of the failing step, before anything draws: torch.save({'cpu': "
              "torch.get_rng_state(), 'cuda': torch.cuda.get_rng_state_all()}, 'rng.pt'), or "
              "torch.save({'batch': batch, 'rng': rng}, 'batch.pt')")


def check_rng_state(rng: Any, *, path: str | os.PathLike | None, what: str, fix: str) -> None:
    """Raise one ``BadInputError`` unless `rng` is ``{"cpu": a CPU generator state, "cuda": None | [uint8
    tensors]}``; `what` names it in the message (``"snapshot 'rng'"``, ``"RNG state"``)."""

    def bad(detail: str) -> BadInputError:
        return BadInputError(f"{what} {detail}", path=path, fix=fix)

    if not isinstance(rng, dict):
        raise bad("should be a dict with a 'cpu' generator state")
    cpu = rng.get("cpu")
    want = torch.get_rng_state().numel()
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8 or cpu.dim() != 1 or cpu.numel() != want:
        got = f"{cpu.dtype} of shape {tuple(cpu.shape)}" if isinstance(cpu, torch.Tensor) else type(cpu).__name__
        raise bad(f"'cpu' should be a uint8 tensor of {want} bytes (torch.get_rng_state()), got {got}")
    check_dense(cpu, path=path, where="rng['cpu']")
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's generator is left as it was
            torch.set_rng_state(cpu)
    except RuntimeError as e:  # "Invalid mt19937 state": bytes that no generator ever produced
        raise bad(f"'cpu' is not a CPU generator state ({str(e).strip()[:80]})") from e
    cuda = rng.get("cuda")
    if cuda is None:
        return
    if not isinstance(cuda, (list, tuple)) or len(cuda) > _MAX_DEVICES or not all(
            isinstance(c, torch.Tensor) and c.dtype == torch.uint8 and c.dim() == 1 and c.numel() <= _MAX_CUDA_BYTES
            for c in cuda):
        raise bad("'cuda' should be None or a list of uint8 tensors (one per device)")
    for i, c in enumerate(cuda):
        check_dense(c, path=path, where=f"rng['cuda'][{i}]")


def _as_state(obj: Any) -> Any:
    """A bare CPU state as the snapshot's dict; ``"cuda": []`` (no CUDA device) as None."""
    if isinstance(obj, torch.Tensor):
        return {"cpu": obj, "cuda": None}
    if isinstance(obj, dict) and set(obj) <= {"cpu", "cuda"} and isinstance(obj.get("cuda"), (list, tuple)) \
            and not obj["cuda"]:
        return {"cpu": obj.get("cpu"), "cuda": None}
    if isinstance(obj, dict) and set(obj) <= {"cpu", "cuda"}:
        return {"cpu": obj.get("cpu"), "cuda": obj.get("cuda")}
    return obj


def load_rng_file(path: str | os.PathLike) -> dict:
    """The RNG state in `path` (``--rng``), validated; one ``BadInputError`` for anything else."""
    from .torchfile import torch_load_safe

    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise BadInputError(f"cannot read the RNG state file ({type(e).__name__})", path=path, fix=RNG_RECIPE) from e
    if size > MAX_RNG_FILE:
        raise BadInputError(f"is {size} bytes, not an RNG state (a few KB)", path=path,
                            fix=f"pass the file that holds the RNG state; {RNG_RECIPE}")
    obj = _as_state(torch_load_safe(path))
    if isinstance(obj, dict) and set(obj) == {"batch", "rng"}:
        raise BadInputError("holds a batch and its RNG state: pass it as --batch, which reads both", path=path,
                            fix="drop --rng, or pass a file of the RNG state alone")
    if isinstance(obj, dict) and not set(obj) <= {"cpu", "cuda"}:
        keys = ", ".join(repr(k)[:20] for k in list(obj)[:4])
        raise BadInputError(f"is not an RNG state: a dict with keys {keys} (expected 'cpu' and 'cuda')", path=path,
                            fix=RNG_RECIPE)
    check_rng_state(obj, path=path, what="RNG state", fix=RNG_RECIPE)
    return obj


def split_batch_rng(obj: Any, path: str | os.PathLike) -> tuple[Any, dict | None]:
    """``(batch, rng)`` of a ``--batch`` file: ``{"batch": B, "rng": R}`` (exactly those keys) holds both; any
    other object is the batch alone (rng None)."""
    if not (isinstance(obj, dict) and set(obj) == {"batch", "rng"} and all(isinstance(k, str) for k in obj)):
        return obj, None
    rng = _as_state(obj["rng"])
    check_rng_state(rng, path=path, what="the batch file's 'rng' entry", fix=RNG_RECIPE)
    return obj["batch"], rng

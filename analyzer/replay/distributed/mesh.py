"""The recorded device mesh a distributed replay rebuilds: 1-D over every rank, or HSDP's 2-D mesh as recorded.

The snapshot's ``fsdp["mesh"]`` (``recorders._fsdp``) holds the mesh's shape, dimension names and, since
format 9, each dimension's placement of a parameter. HSDP (``fully_shard`` on a 2-D mesh without
``dp_mesh_dims``) replicates on dimension 0 and shards on dimension 1: ``["replicate", "shard(0)"]``.

Example:
    >>> hsdp_mesh("s.pt", {"shape": [4], "dim_names": None, "placements": ["shard(0)"]}, 4) is None
    True
    >>> hsdp_mesh("s.pt", {"shape": [2, 2], "dim_names": ["replicate", "shard"],
    ...                    "placements": ["replicate", "shard(0)"]}, 4)
    ([2, 2], ['replicate', 'shard'])
"""
from __future__ import annotations

from typing import Any

from ...errors import BadInputError

__all__ = ["HSDP_PLACEMENTS", "hsdp_mesh"]

HSDP_PLACEMENTS = ["replicate", "shard(0)"]  # a parameter under fully_shard on a 2-D mesh: HSDP
_NAME_LIMIT = 64


def _names(raw: Any, ndim: int) -> list[str] | None:
    """The recorded dimension names when they are `ndim` distinct short strings (``init_device_mesh`` takes
    them); None otherwise: the names shape nothing FSDP2 does on an HSDP mesh."""
    if not isinstance(raw, list) or len(raw) != ndim:
        return None
    if not all(isinstance(n, str) and 0 < len(n) <= _NAME_LIMIT and n.isprintable() for n in raw):
        return None
    return list(raw) if len(set(raw)) == ndim else None


def hsdp_mesh(path: str, mesh: Any, ranks: int) -> tuple[list[int], list[str] | None] | None:
    """The recorded HSDP mesh's (shape, dim names), rebuilt as it was; None: a 1-D mesh, rebuilt over every rank.

    A 2-D mesh is rebuilt only when its parameters were replicated on dim 0 and sharded on dim 1 (HSDP, as
    ``fully_shard(mesh=init_device_mesh(..., (R, S)))`` has it) and on the R x S ranks it had: another shape
    would shard and reduce another way.

    Raises:
        BadInputError: any other mesh of more than one dimension (FSDP2 with tensor or another parallelism,
            placements unrecorded), or `ranks` other than R x S.
    """
    shape = mesh.get("shape") if isinstance(mesh, dict) else None
    if not isinstance(shape, list) or len(shape) <= 1:
        return None
    dims = "x".join(str(d) for d in shape[:8])[:80]
    names = _names(mesh.get("dim_names"), len(shape))
    named = f" ({', '.join(names)})" if names else ""
    one = "replay it in one process: analyzer replay SNAPSHOT, without torchrun"
    placed = mesh.get("placements")
    if len(shape) != 2 or placed != HSDP_PLACEMENTS \
            or not all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= 1 << 20 for d in shape):
        how = f" placed {[str(p)[:20] for p in placed[:8]]}" if isinstance(placed, list) else \
            " (its placements unrecorded)"
        raise BadInputError(f"the run sharded on a {len(shape)}-D device mesh of {dims}{named}{how}: the "
                            "distributed replay rebuilds 1-D meshes and HSDP's 2-D mesh (parameters "
                            "replicated on dim 0, sharded on dim 1) only"[:300], path=path, fix=one)
    if ranks != shape[0] * shape[1]:
        raise BadInputError(f"the run sharded with HSDP on a {dims} device mesh{named} and this replay has {ranks} "
                            f"rank(s): the replay rebuilds that mesh as recorded, on {shape[0] * shape[1]} ranks"
                            [:300], path=path, fix=f"launch with --nproc-per-node {shape[0] * shape[1]}, or {one}")
    return shape, names

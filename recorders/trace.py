"""Per-step trace buffering and atomic Parquet parts (``schema.STEP_COLUMNS`` / ``LAYER_COLUMNS``).

Step rows are host values (they come out of the step's one host sync). Per-layer statistics
stay on the device in a preallocated buffer and cross to the host once per flush.
"""
from __future__ import annotations

import os
from pathlib import Path

import polars as pl
import torch

from . import schema
from ._io import claim_write

__all__ = ["TraceWriter", "LayerBuffer"]

# Columns of the device buffer, in order.
_GRAD_NORM, _PARAM_NORM, _ZERO_FRAC, _UPDATE_RMS, _UNCHANGED = 0, 1, 2, 3, 4
_WIDTH = 5


class LayerBuffer:
    """Preallocated device buffer of per-parameter statistics, ``rows x params x 5`` float32.

    Filling it launches no host sync; ``drain`` copies the filled rows to the host in one copy.
    """

    def __init__(self, rows: int, n_params: int, device: torch.device):
        self.rows = rows
        self.n_params = n_params
        self.device = device
        # NB: preallocate and touch once: first-touch page faults make fresh buffers ~3x slower.
        self.buf = torch.zeros(rows, n_params, _WIDTH, dtype=torch.float32, device=device)
        self.steps: list[int] = []
        self.has_grad: list[list[bool]] = []
        self.has_update: list[list[bool]] = []  # update_rms / unchanged_frac are meaningful
        self.nonfinite: list[list[int] | None] = []

    def release(self) -> None:
        """Free the device memory; the buffer holds nothing afterwards."""
        self.buf = torch.empty(0, self.n_params, _WIDTH, dtype=torch.float32, device=self.device)  # not a view
        self.rows = 0

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def full(self) -> bool:
        return len(self.steps) >= self.rows

    def put(self, step: int, idx: list[int] | None, where: torch.Tensor | None, grad_norms: torch.Tensor,
            param_norms: torch.Tensor, zero_frac: torch.Tensor,
            nonfinite: list[int] | None, update: tuple[torch.Tensor, torch.Tensor, list[bool]] | None = None) -> None:
        """Store one step. `idx`: the parameter indices the grad statistics belong to (None: all);
        `where`: the same indices as a device tensor.

        `nonfinite` is the exact per-parameter count when the cold path computed it, else None
        (meaning 0 for every parameter that has a gradient). `update` is ``UpdateSample.measure()``:
        (update_rms, unchanged_frac, which entries are meaningful), or None (all null).
        """
        row = self.buf[len(self.steps)]
        row[:, _PARAM_NORM].copy_(param_norms)
        if update is not None:
            row[:, _UPDATE_RMS].copy_(update[0])
            row[:, _UNCHANGED].copy_(update[1])
        if idx is None:
            row[:, _GRAD_NORM].copy_(grad_norms)
            row[:, _ZERO_FRAC].copy_(zero_frac)
            has = [True] * self.n_params
        else:
            row[:, _GRAD_NORM].fill_(float("nan"))
            row[:, _ZERO_FRAC].fill_(float("nan"))
            if idx:
                row[:, _GRAD_NORM].index_copy_(0, where, grad_norms)
                row[:, _ZERO_FRAC].index_copy_(0, where, zero_frac)
            has = [False] * self.n_params
            for i in idx:
                has[i] = True
        self.steps.append(step)
        self.has_grad.append(has)
        self.has_update.append(list(update[2]) if update is not None else [False] * self.n_params)
        self.nonfinite.append(nonfinite)

    def drain(self, rank: int) -> pl.DataFrame:
        """Move the filled rows to the host as a long-format frame and empty the buffer."""
        n, p = len(self.steps), self.n_params
        # NB: host sync: one device->host copy of the whole buffer per flush.
        host = self.buf[:n].to("cpu").reshape(n * p, _WIDTH).tolist() if n else []
        has = [h for row in self.has_grad for h in row]
        upd = [h for row in self.has_update for h in row]
        nonfinite: list[int | None] = []
        for row_has, counts in zip(self.has_grad, self.nonfinite):
            if counts is None:
                nonfinite.extend(0 if h else None for h in row_has)
            else:
                nonfinite.extend(c if h else None for h, c in zip(row_has, counts))
        frame = pl.DataFrame(
            {
                "step": [s for s in self.steps for _ in range(p)],
                "rank": [rank] * (n * p),
                "layer": list(range(p)) * n,
                "grad_norm": [r[_GRAD_NORM] if h else None for r, h in zip(host, has)],
                "param_norm": [r[_PARAM_NORM] for r in host],
                "grad_nonfinite": nonfinite,
                "grad_zero_frac": [r[_ZERO_FRAC] if h else None for r, h in zip(host, has)],
                "update_rms": [r[_UPDATE_RMS] if u else None for r, u in zip(host, upd)],
                "unchanged_frac": [r[_UNCHANGED] if u else None for r, u in zip(host, upd)],
            },
            schema=schema.LAYER_COLUMNS,
        )
        self.steps, self.has_grad, self.nonfinite, self.has_update = [], [], [], []
        return frame


class TraceWriter:
    """Writes trace parts for one rank and writer: ``trace/steps-rRRRRR[-wN]-pNNNNNN.parquet``, ``layers-...``.

    Each part name is claimed when it is written (``claim_write``: a hard link that fails
    rather than overwrite), so a resumed run, or another process recording into the same
    directory, never loses a part: a taken index is skipped. Listing the directory first
    only saves failed claims.
    """

    def __init__(self, run_dir: Path, rank: int, writer: int = 0):
        self.dir = Path(run_dir) / schema.TRACE_DIR
        self.rank = rank
        self.writer = writer
        self.next_index = 0
        if self.dir.is_dir():
            found = []
            with os.scandir(self.dir) as entries:
                for entry in entries:
                    m = schema.PART_RE.match(entry.name)
                    if m and int(m[2]) == rank and int(m[3] or 0) == writer:
                        found.append(int(m[4]))
            self.next_index = max(found, default=-1) + 1

    def write(self, steps: list[dict], layers: pl.DataFrame | None) -> list[Path]:
        """Write one part of each kind (skipping empty ones) under claimed names; returns the paths."""
        self.dir.mkdir(parents=True, exist_ok=True)
        index = self.next_index
        self.next_index += 1  # a failed write burns its index: no later part may reuse the name
        written = []
        if steps:
            frame = pl.DataFrame(steps, schema=schema.STEP_COLUMNS)
            path, index = self._write(frame, "steps", index)
            written.append(path)
        if layers is not None and layers.height:
            path, index = self._write(layers, "layers", index)
            written.append(path)
        self.next_index = max(self.next_index, index + 1)
        return written

    def _write(self, frame: pl.DataFrame, kind: str, index: int) -> tuple[Path, int]:
        return claim_write(lambda i: self.dir / schema.part_name(kind, self.rank, i, self.writer), index,
                           lambda f: frame.write_parquet(f))

"""Per-step trace buffering and atomic Parquet parts (``schema.STEP_COLUMNS`` / ``LAYER_COLUMNS`` / ``FP8_COLUMNS``).

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

__all__ = ["TraceWriter", "LayerBuffer", "GRAD_NORM", "PARAM_NORM", "UPDATE_RMS", "UNCHANGED", "ZERO_FRAC",
           "SAMPLED"]

# Rows of a step's (5, params) block in the device buffer, in order: each statistic is one
# contiguous row, so a whole column of a layer row is written by one op.
GRAD_NORM, PARAM_NORM, UPDATE_RMS, UNCHANGED, ZERO_FRAC = 0, 1, 2, 3, 4
_WIDTH = 5
SAMPLED = slice(PARAM_NORM, _WIDTH)  # the rows UpdateSample.measure_into writes, in its order


class LayerBuffer:
    """Preallocated device buffer of per-parameter statistics, ``rows x 5 x params`` float32.

    Filling it launches no host sync; ``drain`` copies the filled rows to the host in one copy.
    A step's block is ``next_block()``, filled in place and recorded with ``commit``.
    """

    def __init__(self, rows: int, n_params: int, device: torch.device):
        self.rows = rows
        self.n_params = n_params
        self.device = device
        # NB: preallocate and touch once: first-touch page faults make fresh buffers ~3x slower.
        self.buf = torch.zeros(rows, _WIDTH, n_params, dtype=torch.float32, device=device)
        self.steps: list[int] = []
        self.has_grad: list[list[bool]] = []
        self.has_update: list[list[bool]] = []  # update_rms / unchanged_frac are meaningful
        self.nonfinite: list[list[int] | None] = []
        self._all = [True] * n_params
        # NB: each step's block and its sampled rows, as views made once: slicing is an op per call
        self._blocks = list(self.buf.unbind(0))
        self._sampled = [b[SAMPLED] for b in self._blocks]

    def release(self) -> None:
        """Free the device memory; the buffer holds nothing afterwards."""
        self.buf = torch.empty(0, _WIDTH, self.n_params, dtype=torch.float32, device=self.device)  # not a view
        self._blocks, self._sampled = [], []
        self.rows = 0

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def full(self) -> bool:
        return len(self.steps) >= self.rows

    def next_block(self) -> torch.Tensor:
        """The ``(5, params)`` block the next ``commit`` records: grad_norm, param_norm, update_rms,
        unchanged_frac, grad_zero_frac, one row each. Call ``drain`` first when ``full``."""
        return self._blocks[len(self.steps)]

    def next_sampled(self) -> torch.Tensor:
        """``next_block()[SAMPLED]``: the rows ``UpdateSample.measure_into`` writes."""
        return self._sampled[len(self.steps)]

    def commit(self, step: int, idx: list[int] | None, nonfinite: list[int] | None, has_update: list[bool]) -> None:
        """Record `step` as the block ``next_block()`` returned, now filled. `idx`: the parameters
        that have a gradient (None: all); the other parameters' gradient columns are null."""
        if idx is None:
            has = self._all  # NB: shared, never mutated
        else:
            has = [False] * self.n_params
            for i in idx:
                has[i] = True
        self.steps.append(step)
        self.has_grad.append(has)
        self.has_update.append(has_update)
        self.nonfinite.append(nonfinite)

    def drain(self, rank: int) -> pl.DataFrame:
        """Move the filled rows to the host as a long-format frame and empty the buffer."""
        n, p = len(self.steps), self.n_params
        # NB: host sync: one device->host copy of the whole buffer per flush; then one flat list
        # per statistic, in (step, layer) order: no list per row for the garbage collector to track
        host = self.buf[:n].to("cpu") if n else torch.empty(0, _WIDTH, p)
        col = [host[:, k].reshape(-1).tolist() for k in range(_WIDTH)]
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
                "grad_norm": [v if h else None for v, h in zip(col[GRAD_NORM], has)],
                "param_norm": col[PARAM_NORM],
                "grad_nonfinite": nonfinite,
                "grad_zero_frac": [v if h else None for v, h in zip(col[ZERO_FRAC], has)],
                "update_rms": [v if u else None for v, u in zip(col[UPDATE_RMS], upd)],
                "unchanged_frac": [v if u else None for v, u in zip(col[UNCHANGED], upd)],
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

    def write(self, steps: list[dict], layers: pl.DataFrame | None, fp8: pl.DataFrame | None = None) -> list[Path]:
        """Write one part of each kind (skipping empty ones) under claimed names; returns the paths.
        `fp8`: the FP8 casts of the steps (``schema.FP8_COLUMNS``, ``recorders._fp8_watch``)."""
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
        if fp8 is not None and fp8.height:
            path, index = self._write(fp8, "fp8", index)
            written.append(path)
        self.next_index = max(self.next_index, index + 1)
        return written

    def _write(self, frame: pl.DataFrame, kind: str, index: int) -> tuple[Path, int]:
        return claim_write(lambda i: self.dir / schema.part_name(kind, self.rank, i, self.writer), index,
                           lambda f: frame.write_parquet(f))

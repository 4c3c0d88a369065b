"""The recorder counts every FP8 cast the recipe makes, as the replay sees torchao make it: for each module, operand
role and GEMM that reads the operand (its ``use``), the recorder's trace row holds the same counts as the replay's
``CastWatch``, which reads them from torchao's own ops (the scale, the clamp's input, the float8 result). So the
axis of each rowwise or MX scale is torchao's, not a guess; a tensorwise second use, left out by the recorder,
is checked to make the first use's counts."""
from __future__ import annotations

import polars as pl
import pytest
import torch

from analyzer.load import load_run, load_snapshot
from recorders import schema
from tests.extras import require

from . import grad_models as gm
from . import mx_models as mx
from . import swiglu_models as sm
from .test_recorded_fp8 import _train

require("torchao.float8", "fp8")

_KEYS = ("numel", "nonzero", "flushed", "saturated", "subnormal")


def _record(kind: str, run_dir) -> list:
    if kind == "tensorwise":  # the aligned SwiGLU: its w2 input flushes (forward GEMM)
        return _train(run_dir, "tensorwise", steps=1)
    if kind == "rowwise":  # heavy tokens: the weight gradients' grad_output flushes
        return gm.train(run_dir)
    return mx.train_mx(run_dir, massive=True)  # MXFP8: blocks of 32 along each GEMM's reduction dim


@pytest.mark.parametrize("kind", ["tensorwise", "rowwise", "mxfp8"])
def test_each_recorded_cast_has_the_counts_the_replay_reads_from_torchaos_own_cast(tmp_path, kind):
    from analyzer.replay import Replay

    snaps = _record(kind, tmp_path / "run")
    fp8_snaps = [p for p in snaps if p.name.endswith(f"-{schema.FP8}.pt")]
    assert fp8_snaps, "the recorder's own trigger wrote no fp8 snapshot"
    rows = load_run(tmp_path / "run").fp8.filter(pl.col("step") == 0).collect()
    recorded = {(r["module"], r["role"], r["use"]): tuple(r[k] for k in _KEYS) for r in rows.iter_rows(named=True)}
    ev = Replay(fp8_snaps[0], device="cpu").run().diagnosis.evidence["fp8"]
    replayed = {(c.module, c.role, c.use): tuple(getattr(c.stats, k) for k in _KEYS) for c in ev.casts}
    assert len(replayed) == len(ev.casts) == 6 * 6  # every Linear casts 3 operands for 2 GEMMs each
    for key, counts in replayed.items():
        module, role, use = key
        if kind == "tensorwise" and use != schema.FP8_FIRST_USE[role]:
            assert key not in recorded  # one scale, one format: the first use's counts, not counted twice
            key = (module, role, schema.FP8_FIRST_USE[role])
        assert recorded[key] == counts, key
    assert len(recorded) == (6 * 3 if kind == "tensorwise" else 6 * 6)
    fired = load_snapshot(fp8_snaps[0]).fp8["fired"]
    assert recorded[(fired["module"], fired["role"], fired["use"])] == tuple(fired[k] for k in _KEYS)

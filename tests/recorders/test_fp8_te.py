"""Transformer Engine's FP8 state (``fp8_meta``: amax history and scale per GEMM operand) in every snapshot.

TE runs on CUDA only and is not installable on CPU: the real-TE test needs both and skips otherwise. The reader is
duck-typed (a module whose class lives in ``transformer_engine.pytorch`` and holds ``fp8_meta``), which the first
test exercises on CPU with a module of that shape.
"""
from __future__ import annotations

import json
import types

import pytest
import torch
from torch import nn

from analyzer.load import load_snapshot
from recorders import Recorder


class _TELinear(nn.Linear):
    """Shaped like ``transformer_engine.pytorch.Linear`` after an FP8 step under delayed scaling: ``fp8_meta``
    holds an FP8TensorMeta-like object per direction, amax history (history, 3 operands forward / 2 backward)."""

    def __init__(self):
        super().__init__(8, 8)
        hist = torch.arange(12, dtype=torch.float32).reshape(4, 3)
        self.fp8_meta = {"recipe": "DelayedScaling(margin=0, amax_history_len=4)",
                         "scaling_fwd": types.SimpleNamespace(amax_history=hist, scale=torch.tensor([2.0, 4.0, 8.0])),
                         "scaling_bwd": types.SimpleNamespace(amax_history=torch.ones(4, 2), scale=torch.ones(2))}


_TELinear.__module__ = "transformer_engine.pytorch.module.linear"


def test_a_transformer_engine_modules_fp8_meta_goes_into_the_snapshot_by_operand(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), _TELinear())
    with Recorder(tmp_path, model) as rec:
        rec.begin_step(0, {"x": torch.ones(2, 8)})
        model(torch.ones(2, 8)).sum().backward()
        rec.end_step(1.0)
        path = rec.snapshot()
    te = load_snapshot(path).fp8["transformer_engine"]["1"]
    assert te["class"] == "transformer_engine.pytorch.module.linear._TELinear"
    assert te["scaling_fwd"]["columns"] == ["gemm1_input", "gemm1_weight", "gemm1_output"]
    assert te["scaling_bwd"]["columns"] == ["gemm1_grad_output", "gemm1_grad_input"]
    assert torch.equal(te["scaling_fwd"]["amax_history"], torch.arange(12.0).reshape(4, 3))
    assert te["scaling_fwd"]["scale"].tolist() == [2.0, 4.0, 8.0]
    assert json.loads((tmp_path / "meta.json").read_text())["fp8"]["transformer_engine"] == ["1"]


@pytest.mark.cuda
def test_a_real_transformer_engine_linear_keeps_its_amax_history_in_the_snapshot(tmp_path):
    te = pytest.importorskip("transformer_engine.pytorch")
    recipe = pytest.importorskip("transformer_engine.common.recipe")
    if not torch.cuda.is_available():
        pytest.skip("Transformer Engine needs a CUDA device")
    model = te.Linear(32, 32).cuda()
    x = torch.randn(16, 32, device="cuda")
    with Recorder(tmp_path, model) as rec:
        rec.begin_step(0, {"x": x})
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling(amax_history_len=8)):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        rec.end_step(loss)
        path = rec.snapshot()
    fwd = load_snapshot(path).fp8["transformer_engine"][""]["scaling_fwd"]
    assert fwd["amax_history"].shape[0] == 8 and fwd["columns"][:2] == ["gemm1_input", "gemm1_weight"]
    assert fwd["amax_history"][:, 0].max() > 0  # the input's amax was recorded by TE's own step

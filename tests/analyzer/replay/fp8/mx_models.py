"""MXFP8 training runs of the tiny transformer of ``swiglu_models``: torchao's emulated MXFP8 on CPU.

torchao 0.18 trains MXFP8 on CPU through ``MXFP8TrainingOpConfig`` with ``KernelPreference.EMULATED``, in BF16
parameters without autocast (its emulated GEMM refuses CPU autocast's FP32 weight beside a BF16 input). Every
dimension a block of 32 runs along is a multiple of 32 here (64 tokens, widths 32, 64 and 96).

``build_massive``: channels ``MASSIVE`` of w1/w3 point along one embedding direction every token carries, with
norm ``MASSIVE_GAIN``: on every token those two channels of w2's input are about 4e4 (a "massive activation")
while the others stay near 0.01, one such channel in each block of 32. w2's columns for them are 0 (the channel
is dead downstream), so w2's output comes from the small channels alone. One e8m0 scale per block set by 4e4
flushes every value below about 0.09 to zero: most of w2's input, in every block.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from . import swiglu_models as sm

REF = "tests.analyzer.replay.fp8.mx_models"
MASSIVE, MASSIVE_DIR, MASSIVE_GAIN = (5, 37), sm.DIM - 2, 200.0
TOP = 1.99  # a mantissa above 448 / 256 = 1.75: FLOOR's e8m0 scale maps it past e4m3's 448 (clamped by 12%)


def build(massive: bool = False, top_binade: bool = False) -> nn.Module:
    model = sm.build(aligned=False)
    if top_binade:  # every Linear weight +-1.99 * 2**-6: each block's amax in the top eighth of its binade
        with torch.no_grad():
            for lin in (m for m in model.modules() if isinstance(m, nn.Linear)):
                lin.weight.copy_(torch.sign(lin.weight) * TOP * 2.0 ** -6)
    if massive:
        with torch.no_grad():
            model.emb.weight[:, MASSIVE_DIR] = 1.0
            mlp = model.block.mlp
            for lin in (mlp.w1, mlp.w3):
                lin.weight[list(MASSIVE)] = 0.0
                lin.weight[list(MASSIVE), MASSIVE_DIR] = MASSIVE_GAIN
            mlp.w2.weight[:, list(MASSIVE)] = 0.0
    return model


def mx_config(mode: str = "rceil"):
    """torchao's emulated MXFP8 training config (``mode``: the e8m0 scale's rounding, ``rceil`` or ``floor``)."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    return MXFP8TrainingOpConfig(kernel_preference=KernelPreference.EMULATED,
                                 scale_calculation_mode=ScaleCalculationMode(mode))


def to_mxfp8(model: nn.Module, mode: str = "rceil") -> nn.Module:
    """Convert every Linear of `model` for MXFP8 training in place, as a training script does."""
    from torchao.quantization import quantize_

    quantize_(model, mx_config(mode), filter_fn=lambda m, _fqn: isinstance(m, nn.Linear))
    return model


def train_mx(run_dir, *, massive: bool = False, top_binade: bool = False, mode: str = "rceil", steps: int = 1,
             snapshot: bool = False) -> list[Path]:
    """Train in BF16 parameters with emulated MXFP8 Linears under the real Recorder (``fp8_every=1``); the
    recorder's own trigger writes the snapshots (`snapshot`: the last step is also snapshotted by hand, as
    ``rec.snapshot("fp8")``, where the trigger writes none). Returns them."""
    from recorders import Recorder

    model = to_mxfp8(build(massive, top_binade).to(torch.bfloat16), mode)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with Recorder(run_dir, model, factory=f"{REF}:build", factory_kwargs={"massive": massive, "top_binade": top_binade},
                  loss_fn=f"{sm.REF}:lm_loss", optimizer=opt, fp8_every=1) as rec:
        for step in range(steps):
            b = sm.batch(step)
            rec.begin_step(step, b)
            loss = sm.lm_loss(model, b)
            loss.backward()
            if snapshot and step == steps - 1:
                rec.snapshot("fp8")
            rec.end_step(loss)
            opt.step()
            opt.zero_grad()
    return list(rec.snapshots)


def build_mx(massive: bool = False, top_binade: bool = False) -> nn.Module:
    """A factory that returns the model already converted for MXFP8 training: replay reads the recipe from it."""
    return to_mxfp8(build(massive, top_binade))

"""The AMP dtype an HF Trainer run trains in, read from its ``TrainingArguments`` and accelerate's GradScaler.

NB: ``fp16=True`` with ``use_cpu=True`` is accepted without a word by transformers/accelerate and then
trains in plain FP32 (accelerate creates neither autocast nor a GradScaler for FP16 on CPU): such a run
is recorded as FP32, with one warning.

    >>> from types import SimpleNamespace
    >>> trainer_amp_dtype(SimpleNamespace(bf16=True), None, None, print)
    torch.bfloat16
"""
from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["trainer_amp_dtype", "FP16_CPU_AS_FP32"]

FP16_CPU_AS_FP32 = ("amp-autopsy: fp16=True but the Trainer made no GradScaler (accelerate runs FP16 on CPU as plain "
                    "FP32, without autocast): recording the run as FP32")


def trainer_amp_dtype(args, scaler, model, warn: Callable[[str], None]) -> torch.dtype | None:
    """BF16 for ``bf16=True``; FP16 for ``fp16=True`` with a GradScaler or off CPU; else None (FP32), and
    ``warn(FP16_CPU_AS_FP32)`` for ``fp16=True`` that trains in FP32 (the callback keeps it as a RecorderWarning)."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        on_cpu = next(model.parameters()).device.type == "cpu"
        if scaler is not None or not on_cpu:  # no torch GradScaler off CPU: DeepSpeed scales itself
            return torch.float16
        warn(FP16_CPU_AS_FP32)
    return None

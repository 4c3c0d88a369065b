"""Which scaled-dot-product-attention backends the process allowed: the snapshot's ``sdpa`` key.

``F.scaled_dot_product_attention`` picks a kernel per call from process-wide switches: the
flash, memory-efficient, cuDNN and math backends (``torch.backends.cuda.*_sdp_enabled``,
which ``torch.nn.attention.sdpa_kernel`` sets) and whether the math backend may compute in
FP16/BF16 (``allow_fp16_bf16_reduction_math_sdp``). The kernels fail differently: the math
backend with reduced precision overflows QKᵀ in FP16 (pytorch/pytorch#119131), while the
fused kernels keep the logits in FP32. Replay restores these switches so that it runs the
kernel training ran.

NB: despite their ``cuda`` namespace, the switches govern CPU dispatch too (checked on torch
2.13): with ``flash`` off, CPU runs the math decomposition instead of
``aten._scaled_dot_product_flash_attention_for_cpu``; ``mem_efficient`` and ``cudnn`` exist
on CUDA only. With the reduction switch off (the default), the math backend upcasts FP16/BF16
inputs to FP32 on CPU and CUDA alike.

NB: the switches are read when the snapshot is written (a few C calls, nothing per step). A
loop that enables a backend only around its forward (``with sdpa_kernel(...): loss = ...``)
and snapshots after the block has its global switches recorded, not the block's.

Example:
    >>> sdpa_state()["enabled"]["math"]  # doctest: +SKIP
    True
"""
from __future__ import annotations

import torch

from .schema import SDPA_BACKENDS

__all__ = ["sdpa_state"]

_ENABLED = {
    "flash": "flash_sdp_enabled",
    "mem_efficient": "mem_efficient_sdp_enabled",
    "math": "math_sdp_enabled",
    "cudnn": "cudnn_sdp_enabled",
}


def sdpa_state() -> dict | None:
    """The SDPA switches as this process has them now, or None where torch has none.

    Returns:
        ``{"enabled": {"flash": bool, "mem_efficient": bool, "math": bool, "cudnn": bool},
        "math_reduced_precision": bool | None}``: plain bools, so that
        ``torch.load(weights_only=True)`` reads them. ``math_reduced_precision`` is None on a
        torch without the switch (the math backend then computes in the input's dtype).

    Never raises: a recorder must not take training down for a diagnostic.
    """
    cuda = getattr(torch.backends, "cuda", None)
    try:
        enabled = {name: bool(getattr(cuda, _ENABLED[name])()) for name in SDPA_BACKENDS}
    except Exception:  # noqa: BLE001 - an older or stripped torch: nothing to record
        return None
    try:
        reduced = bool(cuda.fp16_bf16_reduction_math_sdp_allowed())
    except Exception:  # noqa: BLE001 - the switch exists since torch 2.5
        reduced = None
    return {"enabled": enabled, "math_reduced_precision": reduced}

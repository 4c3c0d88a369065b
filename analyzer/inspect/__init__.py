"""``analyzer inspect``: check one checkpoint, or a good/bad pair, for NaN/Inf, FP16/BF16 range risk
and optimizer-state damage.

A real run (a small MLP with Adam; between the two checkpoints Adam's ``exp_avg_sq`` got NaN, a NaN
batch went through BatchNorm and one weight grew past 65504), ``analyzer inspect good.pt bad.pt``::

    findings, worst first:
      error    nonfinite_buffers          bad.pt: 2 buffers hold NaN/Inf: model.1.running_mean (8 of 8 values), model.1.running_var (8 of 8 values); BatchNorm running stats ...
      error    nonfinite_optimizer_state  bad.pt: 1 optimizer tensor holds NaN/Inf: optimizer[model.0.weight].exp_avg_sq (3 of 32 values); ...
      warning  dead_optimizer_state       2 weights never moved between A and B while others did: model.3.weight, model.3.bias; ...
      warning  fp16_range_risk            bad.pt: 1 tensor at FP16 range risk (...): model.0.weight (abs-max 7e+04: 1 value becomes inf)

    tensors of bad.pt, worst first (top 4 of 20):
      role      name                                 dtype    shape    nan/inf   abs-max  min|x|>0 fp16 inf fp16 ->0 bf16 ->0
      buffer    model.1.running_var                  float32  8            8/0         -         -        0        0        0
      optimizer optimizer[model.0.weight].exp_avg_sq float32  8x4          3/0  2.31e-05  6.16e-08        0        0        0
      weight    model.0.weight                       float32  8x4          0/0     7e+04   0.00836     3.1%        0        0

How to read it: findings come first, most severe first, each naming its tensors. The tensor table
below them is sorted worst first (non-finite, then FP16 overflow, then FP16 flush-to-zero, then
abs-max); ``fp16 inf`` / ``fp16 ->0`` / ``bf16 ->0`` are the fractions of values a cast would turn
into inf or zero (thresholds in ``analyzer.inspect._stats``). With two checkpoints a change table
follows: relative L2 change per tensor, the tensors that became non-finite, and the stalled ones.

Findings (stable names): ``implausible_checkpoint`` (a GradScaler scale or a step no training run
saves: NaN, a string, 2**100; the value is named, not used), ``nonfinite_weights``, ``nonfinite_optimizer_state``, ``nonfinite_buffers``,
``nonfinite_inputs`` (a snapshot's batch), ``fp16_range_risk``, ``dead_optimizer_state``,
``optimizer_eps_underflow`` and ``lost_updates`` (FP16/BF16 parameters and their optimizer, ``_optimizer``).

Layout: ``analyzer.load.checkpoint`` / ``analyzer.load.safetensors`` open a file and list its tensors
by role; ``_scan`` (over ``_pieces`` and ``_stats``) is the one torch scan of their values;
``_diagnose`` turns statistics into findings; ``analyzer.render.inspect`` renders them.
"""
from __future__ import annotations

from ._diagnose import (JSON_TENSORS, FileReport, InspectResult, TensorChange, TensorReport, badness,
                        inspect_checkpoints, resolve_device)

__all__ = ["TensorReport", "FileReport", "TensorChange", "InspectResult", "inspect_checkpoints",
           "resolve_device", "badness", "JSON_TENSORS"]

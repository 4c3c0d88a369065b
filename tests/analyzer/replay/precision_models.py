"""Tiny models trained in pure FP16/BF16 (parameters in low precision, no autocast), and a real recorded step.

The factories build the model in FP32, as a training script's factory does before it calls
``model.half()`` (or with ``half=True`` already in the low dtype): replay must rebuild the
precision from the snapshot, not from the factory. ``record_pure_step`` trains one real step
with the ``Recorder`` and returns the snapshot it wrote.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from recorders import Recorder

REF = "tests.analyzer.replay.precision_models"


class Square(nn.Module):
    """h * h: in float16 anything above 255.9 squares past 65504."""

    def forward(self, h):
        return h * h


def build_square_net(gain: float = 200.0, dtype: str = "float32") -> nn.Module:
    """Linear(gain * identity) -> Square -> Linear: x = (2, 0, 0, 0) gives h = 400 and h * h = 160000."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), Square(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4) * gain)
        model[2].weight.fill_(1e-3)  # keeps the FP32 loss small: 160000 * 1e-3 = 160
        model[2].bias.zero_()
    return model.to(getattr(torch, dtype))


def build_classifier(gain: float = 100.0) -> nn.Module:
    """logits = (2g, 0, -2g) for x = (2, 0, 0, 0): p(class 2) = exp(-4g), exactly 0 in FP32 at g = 100."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].weight[0, 0], model[0].weight[2, 0] = gain, -gain
        model[0].bias.zero_()
    return model


def build_classifier_with_half_buffer(gain: float = 100.0) -> nn.Module:
    """``build_classifier`` in FP32 that also keeps a float16 buffer (a lookup table kept small on purpose)."""
    model = build_classifier(gain)
    model.register_buffer("table", torch.ones(3, dtype=torch.float16))
    return model


def mse(model, batch):
    """Loss in the model's own dtype, as pure low-precision training computes it."""
    return F.mse_loss(model(batch["x"]), batch["y"])


def log_prob_loss(model, batch):
    probs = model(batch["x"]).softmax(-1)
    return -torch.log(probs.gather(1, batch["y"][:, None])).mean()


def record_pure_step(run_dir: str | Path, *, factory: str, loss_fn: str, batch: dict, dtype: torch.dtype | None,
                     factory_kwargs: dict | None = None) -> Path:
    """Train one step of ``factory(**kwargs).to(dtype)`` with the Recorder on (no autocast, no scaler).

    The batch's floating tensors are cast to `dtype` too, as a pure low-precision loop does.
    `dtype` None trains the model as the factory built it.
    """
    factory_kwargs = dict(factory_kwargs or {})
    model = globals()[factory](**factory_kwargs)
    if dtype is not None:
        model = model.to(dtype)
        batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rec = Recorder(run_dir, model, factory=f"{REF}:{factory}", factory_kwargs=factory_kwargs,
                   loss_fn=f"{REF}:{loss_fn}", optimizer=opt)
    with rec:
        rec.begin_step(0, batch)
        loss = globals()[loss_fn](model, batch)
        loss.backward()
        if rec.end_step(loss) is None:
            raise AssertionError(f"{factory}/{loss_fn}: the step did not fail, nothing was recorded")
        opt.step()
    assert rec.snapshots, "the recorder wrote no snapshot"
    return rec.snapshots[-1]


# -- FSDP2 with a float16 param_dtype, recorded in one process ------------------------------------
def fsdp_mse(model, batch):
    """The FSDP policy below sets output_dtype=float32: the loss is FP32 like the targets."""
    return F.mse_loss(model(batch["x"]), batch["y"])


def train_fsdp_fp16(_index: int, run_dir: str, init_file: str) -> None:
    """``torch.multiprocessing.spawn`` target: one gloo rank, ``build_square_net`` under ``fully_shard``
    with ``MixedPrecisionPolicy(param_dtype=float16, output_dtype=float32)``, one step recorded with
    ``sync_failures=True`` (so the snapshot's weights go into a DCP directory). Its forward overflows:
    FSDP casts x = (2, 0, 0, 0) and the weights to float16, and 400 * 400 > 65504."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        model = build_square_net()
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32,
                                                          output_dtype=torch.float32))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        batch = {"x": torch.tensor([[2.0, 0, 0, 0], [1.0, 0, 0, 0]]), "y": torch.zeros(2, 1)}
        with Recorder(run_dir, model, factory=f"{REF}:build_square_net", loss_fn=f"{REF}:fsdp_mse",
                      optimizer=opt, sync_failures=True, strict=True) as rec:
            rec.begin_step(0, batch)
            loss = fsdp_mse(model, batch)
            loss.backward()
            if rec.end_step(loss) is None:
                raise AssertionError("the FSDP float16 step did not fail")
            opt.step()
    finally:
        dist.destroy_process_group()

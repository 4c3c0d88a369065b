"""Tiny models whose compiled and eager FP16 steps disagree about finiteness, by mechanisms that need no rounding luck.

``build_gate_net``: compiled-only NaN. ``gate.proj``'s weight is 0.9998 * I, which FP16 autocast
rounds to exactly 1 (the nearest FP16 values are 0.99951 and 1), so an input of exactly 1 gives
c = 1 * 1.0001. Eager FP16 rounds c back to 1 (the FP16 spacing above 1 is 2**-10) and
``(1 - c*c) ** 1.5`` is 0, with gradient 0. Inductor keeps c in FP32 registers: 1 - c*c = -2e-4 and
its power 1.5 is NaN. FP32 eager never rounds the weight: c = 0.99990 and the step is finite.

``build_chain_net``: eager-only overflow (docs/PYTORCH-NOTES: ``z = (h * 512) * 512 / 262144``):
eager FP16 rounds after each op, so ``h * 512 * 512`` passes 65504 for |h| > 0.25 and
``z - z.mean()`` is NaN; Inductor fuses the chain into one FP32 kernel and the step is finite.

``build_drop_net``: a NaN that only dropout's mask decides. ``z = dropout(relu(fc(x)) + 1)`` is 0
where dropped and at least 2 where kept, so ``log(z[:, 0])`` is -inf exactly when the mask drops
that element, in any precision. Compiled, the mask comes from Inductor's RNG, eager from eager's:
``drop_seeds`` finds, for real, seeds where the two masks differ.

``build_drop_gate_net``: ``GateNet``'s compiled-only NaN plus a dropout branch beside it
(``head(gate(x)) + aux(dropout(x))``): the NaN does not depend on the mask, the loss does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["build_gate_net", "build_gate_stack", "build_chain_net", "build_drop_net", "mse_loss", "gate_batch",
           "chain_batch", "drop_batch", "drop_seeds", "build_drop_gate_net", "fresh_inductor"]


class Gate(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.proj(x) * 1.0001
        return (1 - c * c) ** 1.5


class GateNet(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.gate = Gate(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(x))


class GateStack(nn.Module):
    """Repeated blocks (a ``ModuleList`` of one class): what accelerate's ``compile_regions`` compiles one by one."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList([Gate(width), Gate(width)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Chain(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = (h * 512) * 512 / 262144
        return z - z.mean()


class ChainNet(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.chain = Chain()
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.chain(self.fc(x)))


class DropGateNet(GateNet):
    def __init__(self, width: int = 4):
        super().__init__(width)
        self.drop = nn.Dropout(0.5)
        self.aux = nn.Linear(width, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(x)) + self.aux(self.drop(x))


class DropNet(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.drop(torch.relu(self.fc(x)) + 1)
        return self.head(z) + z[:, :1].log()


def _seeded(model: nn.Module, seed: int, std: float) -> nn.Module:
    g = torch.Generator().manual_seed(seed)  # building draws no global RNG
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def build_gate_net(width: int = 4) -> nn.Module:
    model = _seeded(GateNet(width), 0, 0.1)  # small: the backward at GradScaler's 65536 fits FP16
    with torch.no_grad():
        model.gate.proj.weight.copy_(torch.eye(width) * 0.9998)
    return model


def build_gate_stack(width: int = 4) -> nn.Module:
    """``build_gate_net``'s gate twice: the compiled-only NaN is born in ``blocks.0`` (``blocks.1`` sees its
    eager output, at most 1 - 0.9998**2 away from 0, and stays finite either way)."""
    model = _seeded(GateStack(width), 0, 0.1)
    with torch.no_grad():
        for block in model.blocks:
            block.proj.weight.copy_(torch.eye(width) * 0.9998)
    return model


def build_chain_net(width: int = 4) -> nn.Module:
    model = _seeded(ChainNet(width), 0, 0.5)  # |fc(x)| > 0.25: eager's second multiply passes 65504
    with torch.no_grad():
        model.head.weight.mul_(0.1)  # a small output: the backward at GradScaler's 65536 fits FP16
    return model


def build_drop_gate_net(width: int = 4) -> nn.Module:
    model = _seeded(DropGateNet(width), 0, 0.1)
    with torch.no_grad():
        model.gate.proj.weight.copy_(torch.eye(width) * 0.9998)  # GateNet's compiled-only NaN
        model.aux.weight.mul_(0.5)  # the backward at GradScaler's 65536 fits FP16
    return model


def build_drop_net(width: int = 4) -> nn.Module:
    model = _seeded(DropNet(width), 0, 0.1)
    with torch.no_grad():
        model.head.weight.fill_(1.0)  # each kept element moves the output by >= 2: masks show in the loss
    return model


def mse_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]).float(), batch["y"])


def gate_batch() -> dict:
    """Entries in [-1, 1], some exactly 1: only those leave the domain, and only compiled."""
    x = torch.tensor([[1.0, 0.5, -0.25, 0.0], [0.25, 1.0, -0.5, 0.75]])
    return {"x": x, "y": torch.zeros(2, 1)}


def chain_batch() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"x": torch.randn(4, 4, generator=g) * 2, "y": torch.zeros(4, 1)}


def drop_batch() -> dict:
    """One row: the step is non-finite exactly when the mask drops its first element."""
    return {"x": torch.tensor([[0.5, -0.25, 1.0, 0.0]]), "y": torch.zeros(1, 1)}


def drop_seeds(compiled: nn.Module, eager: nn.Module, batch: dict, tries: int = 64) -> tuple[int, int]:
    """(a seed whose compiled FP16 forward is finite with another mask than eager's, a seed whose compiled
    forward is non-finite while eager's is finite): the masks each draws, found by running both."""
    def run(model: nn.Module, seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        with torch.autocast("cpu", dtype=torch.float16):
            return model(batch["x"]).detach()

    ok = bad = None
    for seed in range(tries):
        c, e = run(compiled, seed), run(eager, seed)
        if ok is None and torch.isfinite(c).all() and not torch.allclose(c, e, atol=0.5):  # FP16 rounding: ~1e-3
            ok = seed
        if bad is None and not torch.isfinite(c).all() and torch.isfinite(e).all():
            bad = seed
        if ok is not None and bad is not None:
            return ok, bad
    raise AssertionError(f"no such seeds in {tries} tries: the compiled and eager masks never differed")


def fresh_inductor(fresh: bool = True):
    """A context within which (when `fresh`) Inductor generates every graph's code afresh: its FX graph and
    AOTAutograd caches off.

    NB: Inductor's FX graph cache does not key on the ATen CPU capability: a graph cached by an AVX-512
    run fails to build under ``ATEN_CPU_CAPABILITY=default`` (its C++ uses at::vec) and builds when
    generated afresh. The tests' training loops retry that way, as the replay's compiled runs do.
    """
    import contextlib

    stack = contextlib.ExitStack()
    if fresh:
        stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    return stack

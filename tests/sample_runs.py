"""One training run per sample scenario per test session, shared by every test that reads it.

The scenarios are real training runs (FP16 and BF16 are slow on CPU), and three test files
read the same runs: each is trained once, on first use, into a session temporary folder. The
default ``fp16_attention_overflow`` run is the one ``analyzer demo`` trains (the demo *is* that
scenario), so the demo's own test and the scenario's tests read one run. Tests only read a run
(report, replay), so sharing it cannot couple them.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["DemoRun", "demo_run", "sample_run"]

DEMO_SCENARIO = "fp16_attention_overflow"

# What each failing sample's first snapshot replays to, as its docstring argues: (sample, step,
# verdict, culprit op, culprit module). Replay and autopsy tests both pin these.
FAILING_SAMPLES = [
    # q @ k^T unscaled, then the temperature jump: the matmul overflows FP16 in the first block's attention
    ("fp16_attention_overflow", 24, "overflow", "aten.bmm", "blocks.0.attn"),
    # (x - mean) / std without eps over a constant feature: 0/0 in FP32 as well
    ("bf16_nan", 12, "numerical_bug", "aten.div", "norm"),
    # a padded query row fully masked with -inf: softmax of it is NaN in any precision
    ("masked_padding", 15, "numerical_bug", "aten._softmax", "blocks.0.attn"),
    # a torch.library softplus that autocast feeds FP16
    ("custom_op_outside_autocast", 28, "unregistered_op", "samples.softplus", "features.4"),
    # log of a probability that is exactly 0
    ("log_zero", 20, "numerical_bug", "aten.log", "<loss_fn>"),
]
_RUNS: dict[tuple, Path] = {}
_DEMO: list[DemoRun] = []


@dataclass(frozen=True)
class DemoRun:
    """``analyzer demo --out OUT`` as run once this session: its folder, exit code and output."""

    out: Path
    exit_code: int
    output: str


def demo_run(factory: pytest.TempPathFactory) -> DemoRun:
    """Run ``analyzer demo`` (the default scenario) through the CLI on first use."""
    if not _DEMO:
        from click.testing import CliRunner

        from analyzer.cli import main

        out = factory.mktemp("demo") / "amp-autopsy-demo"
        res = CliRunner().invoke(main, ["demo", "--out", str(out)])
        _DEMO.append(DemoRun(out=out, exit_code=res.exit_code, output=res.output))
    return _DEMO[0]


def sample_run(factory: pytest.TempPathFactory, name: str, **kwargs) -> Path:
    """The run directory of ``samples.<name>.run(..., **kwargs)``, trained on first use."""
    if name == DEMO_SCENARIO and not kwargs:
        demo = demo_run(factory)
        assert demo.exit_code == 0, demo.output
        return demo.out / name
    key = (name, tuple(sorted(kwargs.items())))
    if key not in _RUNS:
        module = importlib.import_module(f"samples.{name}")
        _RUNS[key] = module.run(factory.mktemp(name) / "run", **kwargs)
    return _RUNS[key]

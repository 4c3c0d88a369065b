"""The ``--json`` of ``analyzer replay`` and ``analyzer autopsy`` on every sample scenario, against golden files.

The golden files (``tests/analyzer/replay/golden/CAPABILITY/*.json``, one folder per CPU capability:
``avx512``, ``avx2``, ``default``; compared by ``shape``, the same in all three) were written from the code as it was
before the replay package was restructured; every later change must print the same JSON. What
varies from run to run or machine to machine is masked before comparing: wall times, absolute
paths (the session's temporary folder, the checkout's folder), the torch version. Regenerate with
``AMP_GOLDEN_WRITE=1 python -m pytest tests/analyzer/replay/test_golden_json.py
tests/analyzer/autopsy/test_golden_json.py`` (and again under
``ATEN_CPU_CAPABILITY=avx2`` and ``=default``) only when a change of output is intended.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from analyzer.cli import main

__all__ = ["GOLDEN", "cli_json", "masked", "check_golden", "shape"]

GOLDEN = Path(__file__).parent / "golden"
_REPO = str(Path(__file__).resolve().parents[3])  # source_path is absolute: the checkout's own folder
_TIME_KEYS = re.compile(r"(^|_)(seconds|secs|time|elapsed|wall|duration)(_s)?$|_s$")
_MASK = "<masked>"


def cli_json(*args: str) -> dict:
    """Run ``analyzer ARGS --json`` in process; return the parsed JSON (exit code 0 or 1 only)."""
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code in (0, 1), (res.exit_code, res.output, res.exception)
    start = res.stdout.index("{")
    return json.loads(res.stdout[start:])


def masked(obj, roots: list[str]):
    """``obj`` with run-to-run values masked: times, the torch version, and ``roots`` in paths."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and _TIME_KEYS.search(k):
                out[k] = _MASK
            elif k in ("torch", "torch_version"):
                out[k] = _MASK
            else:
                out[k] = masked(v, roots)
        return out
    if isinstance(obj, list):
        return [masked(v, roots) for v in obj]
    if isinstance(obj, str):
        obj = obj.replace(_REPO, "<repo>")
        for i, root in enumerate(roots):
            obj = obj.replace(root, f"<root{i}>")
        return re.sub(r"torch \d+\.\d+[^\s,;)]*", "torch <v>", obj)
    return obj


def check_golden(name: str, got: dict) -> None:
    """Compare ``got`` with ``golden/CAPABILITY/NAME.json``; write it instead under ``AMP_GOLDEN_WRITE=1``.

    The CPU's SIMD capability (``torch.backends.cpu.get_cpu_capability()``, forced lower with
    ``ATEN_CPU_CAPABILITY``) and MKL's own dispatch change FP16/BF16 and FP32 rounding, so the files are
    written per capability, but what is compared is their ``shape``: the structure, verdicts, culprits,
    op names, wording, counts and steps, which are the same under every capability (checked for
    avx512, avx2 and default, with MKL_CBWR=COMPATIBLE too). A capability without a folder compares
    with avx512's.
    """
    import torch

    cap = torch.backends.cpu.get_cpu_capability().lower()
    path = GOLDEN / cap / f"{name}.json"
    text = json.dumps(got, indent=1, sort_keys=False, allow_nan=False) + "\n"
    if os.environ.get("AMP_GOLDEN_WRITE") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return
    if not path.parent.is_dir():  # another CPU: what is compared (``shape``) is the same for every capability
        path = GOLDEN / "avx512" / f"{name}.json"
    assert path.exists(), f"no golden file {path}: run once with AMP_GOLDEN_WRITE=1"
    want = json.loads(path.read_text())
    assert shape(got) == shape(want), f"{name}: --json differs from {path}"


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def shape(obj, key: str = ""):
    """What the golden test pins on any CPU: the keys, verdicts, culprits, op names, wording, counts and
    steps (the magnitude jump's op too: a tie within rounding goes to the earlier op); not the values the
    CPU's kernels round (floats, numbers in sentences), nor which parameters' gradients are furthest from
    FP32 (``fp32_comparison.worst_params``: their count is pinned)."""
    if key == "worst_params" and isinstance(obj, list):  # which parameters round worst: the kernels' rounding
        return f"<{len(obj)} worst_params>"
    if isinstance(obj, dict):
        return {k: shape(v, k) for k, v in obj.items()}
    if isinstance(obj, list):
        return [shape(v) for v in obj]
    if isinstance(obj, float) or obj in ("nan", "inf", "-inf"):
        return "<float>"
    if isinstance(obj, str):
        return _NUMBER.sub("<n>", obj)
    return obj

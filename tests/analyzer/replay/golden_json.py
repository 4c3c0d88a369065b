"""The ``--json`` of ``analyzer replay`` and ``analyzer autopsy`` on every sample scenario, against golden files.

The golden files (``tests/analyzer/replay/golden/CAPABILITY/*.json``, one folder per CPU capability:
``avx512``, ``avx2``, ``default``) were written from the code as it was
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

__all__ = ["GOLDEN", "cli_json", "masked", "check_golden"]

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
    ``ATEN_CPU_CAPABILITY``) changes FP16/BF16 rounding, so the values (losses, abs-maxima, and which
    of two ops with the same growth is the magnitude jump) are pinned per capability; the
    structure, the verdicts, culprits and wording are the same under all three.
    """
    import torch

    cap = torch.backends.cpu.get_cpu_capability().lower()
    path = GOLDEN / cap / f"{name}.json"
    text = json.dumps(got, indent=1, sort_keys=False, allow_nan=False) + "\n"
    if os.environ.get("AMP_GOLDEN_WRITE") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return
    if not path.parent.is_dir():
        pytest.skip(f"no golden files for CPU capability {cap!r} (written for {sorted(p.name for p in GOLDEN.iterdir())})")
    assert path.exists(), f"no golden file {path}: run once with AMP_GOLDEN_WRITE=1"
    want = json.loads(path.read_text())
    assert got == want, f"{name}: --json differs from {path}"

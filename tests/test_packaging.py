"""Packaging contracts: what `recorders` may import, the CLI entry point, CI == README test command."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_importing_recorders_loads_no_analyzer_dependency():
    # recorders runs inside training: it may import torch and polars only. scipy, matplotlib
    # and click belong to the analyzer; transformers/lightning are optional extras.
    code = (
        "import sys, recorders, recorders.schema, recorders.snapshot, recorders.integrations\n"
        "bad = [m for m in ('scipy', 'matplotlib', 'click', 'transformers', 'lightning', 'analyzer')"
        " if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == ""


def test_the_analyzer_console_script_prints_its_commands():
    out = subprocess.run([sys.executable, "-m", "analyzer.cli", "--help"], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    for command in ("replay", "report", "inspect", "demo"):
        assert re.search(rf"^\s+{command}\s", out.stdout, re.M), command


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```(?:bash|sh)\n(.*?)```", text, re.S)
    assert block, "README must start with a bash block holding the two set-up commands"
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_ci_runs_exactly_the_readme_test_command():
    # The README's first code block holds the two set-up commands: demo first, tests second.
    demo, tests = _readme_commands()[:2]
    assert "analyzer demo" in demo
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = tests.split("&&")[-1].strip()
    assert test_cmd.startswith("python -m pytest")
    ci_lines = [line.strip() for line in ci.splitlines()]
    assert test_cmd in ci_lines, f"CI must run the README test command {test_cmd!r} verbatim"

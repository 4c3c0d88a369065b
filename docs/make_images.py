"""Regenerate the committed demo images (and the demo's text output) under docs/ by running the demo.

Usage, from the repository root::

    python docs/make_images.py

It runs ``analyzer demo`` (the ``fp16_attention_overflow`` scenario) into a temporary folder
named ``amp-autopsy-demo``, as a user would, and writes:

- ``docs/demo-loss-scale.png``: the report's loss and loss-scale plot;
- ``docs/demo-replay.png``: the replay's per-op abs-max plot, per precision;
- ``docs/demo-output.txt``: the demo's full text output, which the excerpts in
  ``README.md`` are copied from (``tests/test_demo.py`` checks they still match).

Takes about 10-20 s on a 2-core CPU.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from analyzer.demo import run_demo

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
OUT_NAME = "amp-autopsy-demo"  # the demo's default --out, so the text reads as a user sees it


def main() -> None:
    lines: list[str] = []
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            out = run_demo(OUT_NAME, echo=lines.append)
        finally:
            os.chdir(cwd)
        shutil.copyfile(Path(tmp) / out.plots[0].parent / "loss_scale.png", DOCS / "demo-loss-scale.png")
        if out.replay_plot is not None:
            shutil.copyfile(Path(tmp) / out.replay_plot, DOCS / "demo-replay.png")
    # Source lines print relative to the run's recorded working directory, here the temporary folder,
    # which samples/ is not under: they are absolute; show them as from the repo root.
    text = "\n".join(lines).replace(f"{REPO}{os.sep}", "")
    (DOCS / "demo-output.txt").write_text(text + "\n")
    for name in ("demo-loss-scale.png", "demo-replay.png", "demo-output.txt"):
        print(f"wrote {DOCS / name}")


if __name__ == "__main__":
    main()

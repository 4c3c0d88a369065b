"""``analyzer demo``: one command trains a failing run, autopsies it (report, replay, fixes tried) and says where
everything is."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from analyzer.cli import main
from analyzer.demo import SCENARIOS, run_demo
from analyzer.errors import AnalyzerError
from samples import bf16_nan, fp16_attention_overflow
from samples._common import snapshots_of
from tests.sample_runs import demo_run, sample_run

REPO = Path(__file__).resolve().parents[1]
README_MD = REPO / "README.md"
DEMO_OUTPUT = REPO / "docs" / "demo-output.txt"
REGENERATE = "run `python docs/make_images.py` and update the excerpts in README.md"


def _readme_excerpts() -> list[str]:
    """Lines of the ```text blocks that README.md marks as demo-output excerpts."""
    blocks = re.findall(r"<!-- excerpt: docs/demo-output.txt -->\n```text\n(.*?)```", README_MD.read_text(), re.S)
    assert blocks, "README.md has no demo excerpts"
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_the_readme_excerpts_are_copied_from_the_committed_demo_output():
    output = set(DEMO_OUTPUT.read_text().splitlines())
    stale = [line for line in _readme_excerpts() if line not in output]
    assert not stale, f"excerpts not in docs/demo-output.txt: {stale}; {REGENERATE}"


def test_the_readme_excerpts_hold_no_trained_values_which_move_with_the_cpu():
    # The demo's steps, scales, verdict and op are fixed by the scenario's mechanism, the same on
    # every CPU; a loss or an activation's size comes out of FP16 training and moves in its 3rd or
    # 4th digit with the CPU's kernels (measured: FP32 loss 2.104 vs 2.106, largest logit 3.39e+05
    # vs 3.4e+05 under ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41). docs/demo-output.txt
    # has them; the README quotes only what every user sees.
    trained = re.compile(r"loss\s+\d|abs-max\s+\d|largest value|last finite loss \d")
    moving = [line for line in _readme_excerpts() if trained.search(line)]
    assert not moving, f"README excerpts quote values that depend on the CPU: {moving}"


@pytest.mark.slow
def test_the_demo_names_the_culprit_and_writes_the_run_plots_and_html(tmp_path_factory):
    demo = demo_run(tmp_path_factory)  # `analyzer demo --out OUT`, shared with the scenario's tests
    out = demo.out
    assert demo.exit_code == 0, demo.output
    text = demo.output
    # The README's excerpts are what the demo prints today, with paths as a user running
    # `analyzer demo` from the repository root sees them.
    printed = set(text.replace(str(out), "amp-autopsy-demo").replace(f"{REPO}{os.sep}", "").splitlines())
    stale = [line for line in _readme_excerpts() if line not in printed]
    assert not stale, f"the demo no longer prints: {stale}; {REGENERATE}"
    # Progress while training, then one autopsy: its answer first, then the report and the replay
    # of the first snapshot as evidence. The run fails at the temperature jump, the same step on
    # every CPU (the scenario explains why).
    bad = fp16_attention_overflow.BAD_STEP
    assert "[fp16_attention_overflow] step   0/60" in text
    assert f"[fp16_attention_overflow] step  {bad}: snapshot step{bad:08d}-r00000-nonfinite_loss.pt" in text
    run_dir = out / "fp16_attention_overflow"
    assert f"[2/2] analyzer autopsy {run_dir} --device cpu\namp-autopsy autopsy: {run_dir}\nverdict: overflow\n" \
           f"answer:\n  root cause: overflow: aten.bmm in `blocks.0.attn` (forward, float16)" in text
    assert (f"  where: aten.bmm in blocks.0.attn at samples/models.py:98, forward, float16, step {bad}, rank 0 "
            f"(step{bad:08d}-r00000-nonfinite_loss.pt)") in text
    # BF16 has FP32's range: the counterfactual replay of the step in BF16 is finite, on every CPU.
    assert "  verified fix: switch from FP16 to BF16: " in text
    answer = text[text.index("answer:"):text.index("evidence 1/2:")]
    failing = [line.split(": ", 2)[1] for line in answer.splitlines() if line.startswith("  tried, fails: ")]
    assert not [line for line in answer.splitlines() if line.startswith("  verified fix: ")
                and line.split(": ", 2)[1] in failing]
    assert text.index("answer:") < text.index(f"Verdict: FAILED: the loss became nan at step {bad} "
                                              f"(nonfinite_loss, step {bad})") < text.index("evidence 2/2:")
    assert f"scale_collapse @ step {bad}:" in text
    # The default scenario's bug is the unscaled q @ k^T in attention, which overflows FP16 in
    # forward (samples/fp16_attention_overflow.py explains why that is the right conclusion).
    assert "verdict: overflow" in text
    assert "aten.bmm in `blocks.0.attn` (forward, float16)" in text
    assert "where everything is:" in text
    scenario = "fp16_attention_overflow"
    written = (out / f"{scenario}.html", out / f"{scenario}-replay.png", out / f"{scenario}-plots" / "loss_scale.png")
    for path in written:
        assert path.exists() and path.stat().st_size > 1000, path
        assert str(path) in text

    # Run again into the same folder with a scenario that never fails: it says there is nothing to
    # replay, and the first scenario's run is left as it was.
    res = CliRunner().invoke(main, ["demo", "--out", str(out), "--scenario", "stalled_layers"])
    assert res.exit_code == 0, res.output
    assert "no snapshot: the run never failed" in res.output
    assert not (out / "stalled_layers" / "snapshots").exists()
    assert (out / scenario / "snapshots").exists()


@pytest.mark.slow
def test_running_a_scenario_again_replaces_its_previous_run(tmp_path, tmp_path_factory):
    # The previous run: a copy of the session's bf16_nan run, plus a snapshot the new run won't write.
    previous = shutil.copytree(sample_run(tmp_path_factory, "bf16_nan"), tmp_path / "bf16_nan")
    first = snapshots_of(previous)[0]
    stale = first.with_name("step00000099-r00000-manual.pt")
    shutil.copyfile(first, stale)
    second = run_demo(tmp_path, scenario="bf16_nan", echo=lambda _: None)
    assert not stale.exists()
    assert second.snapshot.name == first.name
    assert first.name.startswith(f"step{bf16_nan.BAD_STEP:08d}-")  # the batch with the constant flag
    assert second.replay.verdict == "numerical_bug"


def test_an_unknown_scenario_is_a_one_line_error_listing_the_valid_names(tmp_path):
    res = CliRunner().invoke(main, ["demo", "--out", str(tmp_path), "--scenario", "nope"])
    assert res.exit_code == 1
    assert res.output.startswith("Error: unknown scenario 'nope'")
    assert all(name in res.output for name in SCENARIOS)
    assert list(tmp_path.iterdir()) == []


def test_the_demo_refuses_to_replace_a_folder_that_is_not_a_run(tmp_path):
    precious = tmp_path / "healthy" / "notes.txt"
    precious.parent.mkdir()
    precious.write_text("mine")
    with pytest.raises(AnalyzerError, match="not an amp-autopsy run directory"):
        run_demo(tmp_path, scenario="healthy", echo=lambda _: None)
    assert precious.read_text() == "mine"

"""The demo's autopsy page as a user attaches it to a bug report, read back in headless Chromium.

The run is the session's ``analyzer demo`` (``tests/sample_runs.py``: trained once, shared with
``tests/test_demo.py``); its three snapshots blame one op. The page must be small, draw one replay
figure per distinct culprit, and show each source line the same whichever directory the analyzer
runs from: the run is autopsied again from two other working directories (one outside the
recorded one, one above it; nothing is written there), and the text, the JSON and the rendered
pages of both are compared.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from analyzer.autopsy import run_autopsy
from analyzer.render import render_autopsy_text, write_autopsy_html
from recorders import schema

from ... import browser
from ...sample_runs import demo_run

SCENARIO = "fp16_attention_overflow"
MAX_BYTES = 400_000
_SOURCE = re.compile(r"[\w./-]+\.py:\d+")  # a file:line as the pages and the text print it


def _culprit_key(replay: dict):
    c = replay.get("culprit")
    return None if c is None else (replay["verdict"], c["op"], c["module"], c["phase"], c["precision"])


def _autopsy_from(cwd: Path, run_dir: Path, page: Path) -> dict:
    """Autopsy `run_dir` with `cwd` as the working directory: its JSON, its text, its page."""
    before = os.getcwd()
    os.chdir(cwd)
    try:
        result = run_autopsy(run_dir, device="cpu")
        autopsy = json.loads(json.dumps(result.to_dict()))  # what `analyzer autopsy --json` prints
        text = render_autopsy_text(result)
        write_autopsy_html(page, autopsy, report=result.report, replays=list(result.replays), run_dir=run_dir)
    finally:
        os.chdir(before)
    return {"json": autopsy, "text": text, "page": page}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    run = demo_run(tmp_path_factory)
    assert run.exit_code == 0, run.output
    if browser.find_chromium() is None:
        pytest.skip(browser.SKIP_REASON)
    run_dir = run.out / SCENARIO
    where = tmp_path_factory.mktemp("cwds")
    (where / "a").mkdir()
    # outside the recorded cwd, then above it: a path relative to the reader's directory would
    # read absolute from the first and "<its folder>/samples/models.py" from the second
    recorded = os.path.realpath(json.loads((run_dir / schema.META_FILE).read_text())["cwd"])
    cwds = [where / "a", Path(recorded).parent]
    runs = [_autopsy_from(d, run_dir, where / f"page-{i}.html") for i, d in enumerate(cwds)]
    page = run.out / f"{SCENARIO}.html"
    return {"run_dir": run_dir, "page": page, "rendered": browser.render_page(page), "runs": runs,
            "pages": [browser.render_page(r["page"]) for r in runs]}


@pytest.mark.slow  # trains the demo once per session and autopsies it twice
def test_the_demo_page_is_small_and_draws_one_replay_figure_per_distinct_culprit(demo):
    page = demo["page"]
    assert page.stat().st_size < MAX_BYTES, f"{page.stat().st_size} bytes"
    autopsy = demo["runs"][0]["json"]
    replays = autopsy["replays"]
    distinct = {k for k in map(_culprit_key, replays) if k is not None}
    assert len(replays) > len(distinct) >= 1  # the demo's snapshots share their culprit: the case that matters
    shown = demo["rendered"]
    figures = [i for i in shown["images"] if i["cls"] == "replay"]
    assert len(figures) == len(distinct)
    assert all(i["complete"] and i["width"] > 0 and i["height"] > 0 for i in shown["images"])  # palette PNGs decode
    # every later snapshot of a culprit already drawn is one line naming the step whose figure it shares
    primary = replays[0]
    for r in replays[1:]:
        if _culprit_key(r) == _culprit_key(primary):
            assert (f"step {r['step']} ({Path(r['snapshot']).name}, {r['reason']}): {r['verdict']}, same culprit "
                    f"as step {primary['step']}: the figure above") in shown["text"]


@pytest.mark.slow  # trains the demo once per session and autopsies it twice
def test_source_lines_read_the_same_from_two_working_directories_and_the_json_has_the_absolute_path(demo):
    recorded = os.path.realpath(json.loads((demo["run_dir"] / schema.META_FILE).read_text())["cwd"])
    a, b = demo["runs"]
    culprit = a["json"]["culprit"]
    assert culprit == b["json"]["culprit"]  # source and source_path included
    file, line = culprit["source_path"].rsplit(":", 1)
    assert os.path.isabs(file) and Path(file).is_file()
    rel = os.path.relpath(file, recorded)
    assert culprit["source"] == (f"{file}:{line}" if rel.startswith("..") else f"{rel}:{line}")
    ops = [[(o["source"], o["source_path"]) for o in r["json"]["replays"][0]["context_ops"]] for r in (a, b)]
    assert ops[0] == ops[1] and ops[0]
    # what a reader sees: the text answer and every page, from each directory, the demo's own page too
    lines = [set(_SOURCE.findall(r["text"])) for r in (a, b)]
    lines += [set(_SOURCE.findall(p["text"])) for p in (*demo["pages"], demo["rendered"])]
    assert culprit["source"] in lines[0]
    assert all(seen == lines[0] for seen in lines[1:2]), lines  # the two texts
    assert all(seen == lines[2] for seen in lines[3:]), lines  # the three pages
    assert lines[2] <= lines[0]  # a page shows no source line the text does not

"""``write_autopsy_html``: the answer-first page, read back as a browser renders it.

The inputs are real: the FP16 attention sample (the demo's run, trained once per session by
``tests/sample_runs.py``), copied so that it can be moved, its real report, and a real replay of
its first snapshot. NB: the fixes are built by hand here in the ``autopsy --json`` shape, because
the counterfactual replays (``analyzer.replay.fixes``) were not committed when this was written;
each status is still derived from what the real replay measured (the BF16 run's finiteness, the
FP16 forward's first non-finite op), not typed in.

The browser tests run a real headless Chromium (``tests/browser.py``) and skip, saying why, where
none is installed.
"""
from __future__ import annotations

import html
import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.render.autopsy_html import write_autopsy_html
from analyzer.replay import replay_snapshot
from analyzer.report import build_report
from recorders import schema

from ... import browser
from ...sample_runs import sample_run


def _fixes(rj: dict) -> tuple[list[dict], list[dict]]:
    """Fixes and advice in the ``autopsy --json`` shape, each status read off the real replay."""
    runs, c, snap = rj["runs"], rj["culprit"], rj["snapshot"]
    bf16, fp16 = runs["bfloat16"], runs["float16"]
    # the FP16 forward is already non-finite, so no loss scale can help: lowering it fails there
    assert not fp16["forward_finite"]
    fixes = [
        {"snapshot": snap, "name": "bf16", "title": "Switch FP16 to BF16",
         "status": "verified" if bf16["finite"] else "fails",
         "detail": f"step {rj['step']} runs finite in bfloat16" if bf16["finite"] else "still non-finite",
         "precision": "bfloat16", "failing_op": None if bf16["finite"] else bf16["first_nonfinite"]["op"],
         "max_safe_scale": None},
        {"snapshot": snap, "name": "loss_scale", "title": "Lower the loss scale", "status": "fails",
         "detail": "the forward overflows before any scaling", "precision": "float16",
         "failing_op": fp16["first_nonfinite"]["op"], "max_safe_scale": None},
        {"snapshot": snap, "name": "guard_op", "title": f"Guard {c['op']}", "status": "not_tried",
         "detail": f"{c['op']} has no singular input to clamp", "precision": None, "failing_op": None,
         "max_safe_scale": None},
    ]
    advice = [
        {"snapshot": snap, "text": "Divide the attention logits by sqrt(d).", "status": "untested", "fix": None},
        {"snapshot": snap, "text": "Switch to BF16: it has FP32's range.", "status": "verified", "fix": "bf16"},
        {"snapshot": snap, "text": "Lower GradScaler's init_scale.", "status": "untested", "fix": "loss_scale"},
    ]
    return fixes, advice


@pytest.fixture(scope="module")
def moved(tmp_path_factory):
    """The page written for a copy of the FP16 attention run, then page and run moved together."""
    work = tmp_path_factory.mktemp("autopsy") / "work"
    run_dir = work / "run"
    shutil.copytree(sample_run(tmp_path_factory, "fp16_attention_overflow"), run_dir)  # shared: never moved
    rep = build_report(run_dir)
    snap = sorted((run_dir / schema.SNAPSHOT_DIR).glob(schema.SNAPSHOT_GLOB))[0]
    result = replay_snapshot(snap, device="cpu", dtypes=["fp32", "fp16", "bf16"])
    rj = result.to_dict()
    fixes, advice = _fixes(rj)
    autopsy = {"autopsy_version": 1, "run": str(run_dir), "verdict": result.verdict, "culprit": rj["culprit"],
               "answer": [rj["summary"]], "report": rep.to_dict(), "replays": [rj], "fixes": fixes,
               "advice": advice}
    page = write_autopsy_html(work / "pages" / "autopsy.html", autopsy, report=rep, replays=[result],
                              run_dir=run_dir)
    source = page.read_text()
    dest = work.parent / "elsewhere"
    shutil.move(work, dest)
    return {"page": dest / "pages" / "autopsy.html", "snapshot": dest / "run" / schema.SNAPSHOT_DIR / snap.name,
            "autopsy": autopsy, "source": source}


@pytest.fixture(scope="module")
def rendered(moved):
    if browser.find_chromium() is None:
        pytest.skip(browser.SKIP_REASON)
    return browser.render_text(moved["page"])


@pytest.mark.slow  # trains the FP16 attention sample once per session (tests/sample_runs.py)
def test_chromium_renders_verdict_then_culprit_then_fix_statuses_in_that_order(moved, rendered):
    text, _ = rendered
    a = moved["autopsy"]
    c = a["culprit"]
    assert a["verdict"] == "overflow" and c["op"] == "aten.bmm"  # the sample's known answer
    verdict = text.index("Verdict: overflow")
    culprit = text.index(c["op"], text.index("Culprit"))
    verified = text.index("verified: Switch FP16 to BF16")
    fails = text.index(f"fails at {c['op']}: Lower the loss scale")
    not_tried = text.index("not tried: Guard aten.bmm")
    assert verdict < culprit < verified < fails < not_tried
    assert c["module"] in text[culprit:verified] and c["source"] in text[culprit:verified]


@pytest.mark.slow  # trains the FP16 attention sample once per session (tests/sample_runs.py)
def test_chromium_shows_no_advice_that_names_a_failing_fix_and_folds_the_evidence_away(moved, rendered):
    text, _ = rendered
    assert "untested: Divide the attention logits by sqrt(d)." in text
    assert "verified: Switch to BF16" in text
    assert "Lower GradScaler's init_scale" not in text  # its fix (loss_scale) fails
    # the findings read as sentences; their raw evidence is in a closed <details>, not shown
    finding = next(f for f in moved["autopsy"]["report"]["findings"] if f["evidence"])
    key = f'"{next(iter(finding["evidence"]))}": '  # as the folded raw JSON prints it
    assert finding["message"] in text and "evidence" in text
    assert html.escape(key) in moved["source"] and key not in text


@pytest.mark.slow  # trains the FP16 attention sample once per session (tests/sample_runs.py)
def test_the_snapshot_link_chromium_resolves_points_at_the_moved_snapshot(moved, rendered):
    _, links = rendered
    files = [Path(unquote(urlparse(u).path)) for u in links if u.startswith("file:")]
    assert moved["snapshot"] in files and moved["snapshot"].is_file()
    assert all(f.exists() for f in files)  # no link points where the run used to be


@pytest.mark.slow  # trains the FP16 attention sample once per session (tests/sample_runs.py)
def test_a_chromium_screenshot_of_the_page_is_a_real_picture(moved, tmp_path):
    import matplotlib.image as mpimg
    import numpy as np

    if browser.find_chromium() is None:
        pytest.skip(browser.SKIP_REASON)
    png = browser.screenshot(moved["page"], tmp_path / "page.png")
    img = mpimg.imread(png)
    assert img.shape[0] >= 2000 and img.shape[1] >= 1000
    assert img[..., :3].std() > 0.05 and len(np.unique(img[..., :3].reshape(-1, 3), axis=0)) > 50


@pytest.mark.slow  # trains the FP16 attention sample once per session (tests/sample_runs.py)
def test_the_page_is_one_file_with_its_sections_in_reading_order_and_relative_links(moved):
    src = moved["source"]
    order = [src.index(f"id='{s}'") for s in ("verdict", "culprit", "fixes", "replay", "findings", "plots",
                                               "snapshots")]
    assert order == sorted(order)
    assert "http:" not in src and "https:" not in src and "file:" not in src  # nothing fetched, no absolute links
    assert src.count("src='data:image/png;base64,") == 1 + 4  # the replay figure and the report's four plots
    snap = moved["snapshot"].name
    assert re.findall(r"href='([^']*)'", src)[0] == f"../run/snapshots/{snap}"


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: set[str] = set()
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)

    def handle_data(self, data):
        self.text.append(data)


_ALLOWED = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "section", "div", "p", "table",
            "tr", "th", "td", "b", "code", "ul", "li", "span", "a", "img", "details", "summary", "pre"}
_hostile = st.text(alphabet=st.sampled_from(list("<>&'\"/=ab; \n")) | st.characters(), min_size=1, max_size=40)


@pytest.fixture(scope="module")
def small_report(tmp_path_factory):
    path = tmp_path_factory.mktemp("log") / "log.jsonl"
    path.write_text("".join(json.dumps({"step": i, "loss": 2.0 if i < 20 else float("inf")}) + "\n"
                            for i in range(30)))
    return build_report(path)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(s=_hostile, status=st.sampled_from(["verified", "fails", "not_tried", "<b>x</b>"]),
       scale=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)))
def test_strings_from_files_are_escaped_wherever_they_appear(small_report, tmp_path, s, status, scale):
    culprit = {"op": s, "overload": s, "module": s, "source": s, "phase": s, "precision": s, "index": 3}
    autopsy = {"autopsy_version": 1, "run": s, "verdict": s, "culprit": culprit, "answer": [s],
               "report": {"snapshots": [{"file": s, "step": s, "rank": s, "reason": s}]},
               "replays": [{"snapshot": s, "step": s, "summary": s, "verdict": s, "culprit": culprit}],
               "fixes": [{"snapshot": s, "name": s, "title": s, "status": status, "detail": s, "precision": s,
                          "failing_op": s, "max_safe_scale": scale}],
               "advice": [{"snapshot": s, "text": s, "status": "untested", "fix": None}],
               "errors": [{"snapshot": s, "stage": s, "error": s}]}
    page = write_autopsy_html(tmp_path / "p.html", autopsy, report=small_report, replays=[], run_dir=tmp_path)
    parsed = _Tags()
    parsed.feed(page.read_text())
    assert parsed.tags <= _ALLOWED  # no markup from the strings became an element
    text = "".join(parsed.text)
    assert s.encode("utf-8", "backslashreplace").decode() in text
    assert "<script" not in page.read_text().lower()
    if status != "verified":  # a fix that is not verified is never under the recommended heading
        assert "(recommended)" not in text


def test_a_run_without_a_snapshot_says_there_is_no_culprit_and_no_fix(small_report, tmp_path):
    autopsy = {"autopsy_version": 1, "run": "log.jsonl", "verdict": "no_snapshot", "culprit": None,
               "answer": ["no snapshot to replay"], "report": small_report.to_dict(), "replays": [], "fixes": [],
               "advice": []}
    page = write_autopsy_html(tmp_path / "p.html", autopsy, report=small_report, replays=[], run_dir=tmp_path)
    parsed = _Tags()
    parsed.feed(page.read_text())
    text = " ".join(" ".join(parsed.text).split())
    assert "Verdict: no_snapshot" in text and "No culprit: no snapshot was replayed." in text
    assert "No fix was tried." in text and "No snapshots." in text
    assert small_report.findings and all(" ".join(f.message.split()) in text for f in small_report.findings)

"""``write_autopsy_html``: the answer-first page, read back as a browser renders it.

The inputs are real: a copy of the FP16 attention sample (the demo's run, trained once per
session by ``tests/sample_runs.py``; copied because the test moves it) and its real autopsy
(``run_autopsy``: report, replay, the fixes tried on the failing step, advice). The copy keeps
only the first snapshot, so the autopsy replays one step. Hand-built autopsy objects test what a
real run does not reach: advice that names a failing fix, hostile strings, a run without snapshots.

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

from analyzer.autopsy import run_autopsy
from analyzer.render.autopsy_html import write_autopsy_html
from analyzer.report import build_report
from recorders import schema

from ... import browser
from ...sample_runs import sample_run

_LABEL = {"verified": "verified", "changes_result": "changes the result", "fails": "fails", "not_tried": "not tried"}


def _fix_line(f: dict) -> str:
    """How the page labels a fix: its status (with the failing op), then its title."""
    at = f" at {f['failing_op']}" if f["status"] == "fails" and f["failing_op"] else ""
    return f"{_LABEL[f['status']]}{at}: {f['title']}"


@pytest.fixture(scope="module")
def moved(tmp_path_factory):
    """The autopsy page of a copy of the FP16 attention run, then the page and the run moved together."""
    work = tmp_path_factory.mktemp("autopsy") / "work"
    run_dir = work / "run"
    shutil.copytree(sample_run(tmp_path_factory, "fp16_attention_overflow"), run_dir)  # shared: never moved
    snaps = sorted((run_dir / schema.SNAPSHOT_DIR).glob(schema.SNAPSHOT_GLOB))
    for later in snaps[1:]:  # one failing step to replay and try fixes on: the test stays short
        later.unlink()
    result = run_autopsy(run_dir, device="cpu")
    autopsy = json.loads(json.dumps(result.to_dict()))  # exactly what `analyzer autopsy --json` prints
    page = write_autopsy_html(work / "pages" / "autopsy.html", autopsy, report=result.report,
                              replays=list(result.replays), run_dir=run_dir)
    source = page.read_text()
    dest = work.parent / "elsewhere"
    shutil.move(work, dest)
    return {"page": dest / "pages" / "autopsy.html", "snapshot": dest / "run" / schema.SNAPSHOT_DIR / snaps[0].name,
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
    fixes = a["fixes"]
    # BF16 has FP32's range, and bmm's 3.4e5 cast back to FP16 is still inf: at least one of each
    assert {"verified", "fails"} <= {f["status"] for f in fixes}
    verdict = text.index("Verdict: overflow")
    culprit = text.index(c["op"], text.index("Culprit"))
    assert verdict < culprit and c["module"] in text[culprit:] and c["source"] in text[culprit:]
    at = {s: [text.index(_fix_line(f), culprit) for f in fixes if f["status"] == s] for s in _LABEL}
    order = [i for s in ("verified", "changes_result", "fails", "not_tried") for i in sorted(at[s])]
    assert order == sorted(order) and order[0] > culprit  # verified, then fails, then not tried
    recommended = text[text.index("(recommended)"):text.index("(not recommended)")]
    assert all(f["title"] not in recommended for f in fixes if f["status"] != "verified")


@pytest.mark.slow  # trains the FP16 attention sample once per session (tests/sample_runs.py)
def test_chromium_shows_each_advice_line_with_its_status_and_folds_the_evidence_away(moved, rendered):
    text, _ = rendered
    advice = moved["autopsy"]["advice"]
    assert advice
    for x in advice:
        assert f"{x['status']}: {x['text']}" in text  # verified, untested or checked, as the JSON has it
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
@given(s=_hostile, status=st.sampled_from(["verified", "changes_result", "fails", "not_tried", "<b>x</b>"]),
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
    with open(page, encoding="utf-8", newline="") as f:  # read_text() would turn a "\r" from a file into "\n"
        html = f.read()
    parsed = _Tags()
    parsed.feed(html)
    assert parsed.tags <= _ALLOWED  # no markup from the strings became an element
    text = "".join(parsed.text)
    assert s.encode("utf-8", "backslashreplace").decode() in text
    assert "<script" not in html.lower()
    if status != "verified":  # a fix that is not verified is never under the recommended heading
        assert "(recommended)" not in text


def test_a_run_without_a_snapshot_says_there_is_no_culprit_and_no_fix(small_report, tmp_path):
    autopsy = {"autopsy_version": 1, "run": "log.jsonl", "verdict": "no_snapshot", "culprit": None,
               "answer": ["no snapshot to replay"], "report": small_report.to_dict(), "replays": [], "fixes": [],
               "advice": []}
    text = _text(write_autopsy_html(tmp_path / "p.html", autopsy, report=small_report, replays=[],
                                    run_dir=tmp_path))
    assert "Verdict: no_snapshot" in text and "No culprit: no snapshot was replayed." in text
    assert "No fix was tried." in text and "No snapshots." in text
    assert small_report.findings and all(" ".join(f.message.split()) in text for f in small_report.findings)


def _text(page: Path) -> str:
    parsed = _Tags()
    parsed.feed(page.read_text())
    return " ".join("".join(parsed.text).split())


def test_advice_naming_a_failing_fix_is_left_out_and_a_failing_fix_is_never_recommended(small_report, tmp_path):
    def fix(name, status, op=None):
        return {"snapshot": "s.pt", "name": name, "title": f"fix {name}", "status": status, "detail": "why",
                "precision": "float16", "failing_op": op, "max_safe_scale": None}

    autopsy = {"autopsy_version": 1, "run": "r", "verdict": "underflow", "culprit": None, "answer": [],
               "report": {}, "replays": [],
               "fixes": [fix("a", "fails", "aten.log"), fix("b", "verified"), fix("c", "not_tried")],
               "advice": [{"snapshot": "s.pt", "text": "do a", "status": "verified", "fix": "a"},
                          {"snapshot": "s.pt", "text": "do b", "status": "verified", "fix": "b"},
                          {"snapshot": "s.pt", "text": "try d", "status": "untested", "fix": None}]}
    text = _text(write_autopsy_html(tmp_path / "p.html", autopsy, report=small_report, replays=[],
                                    run_dir=tmp_path))
    assert "do a" not in text  # its fix fails, whatever the advice line's own status says
    assert "verified: do b" in text and "untested: try d" in text
    recommended = text[text.index("(recommended)"):text.index("(not recommended)")]
    assert "verified: fix b" in recommended and "fix a" not in recommended
    assert text.index("fails at aten.log: fix a") < text.index("not tried: fix c")


def test_each_distinct_culprit_gets_its_own_fix_list_and_a_fix_failing_on_one_hides_no_advice_of_another(
        small_report, tmp_path):
    def fix(snap, name, status):
        return {"snapshot": snap, "name": name, "title": f"fix {name} on {snap}", "status": status, "detail": None,
                "precision": "float16", "failing_op": None, "max_safe_scale": None}

    autopsy = {"autopsy_version": 1, "run": "r", "verdict": "overflow", "culprit": None, "answer": [], "report": {},
               "replays": [{"snapshot": "run/s40.pt", "step": 40}, {"snapshot": "run/s7.pt", "step": 7}],
               "fixes": [fix("run/s7.pt", "bf16", "fails"), fix("run/s40.pt", "bf16", "verified"),
                         fix("run/s40.pt", "upcast", "fails")],
               "advice": [{"snapshot": "run/s40.pt", "text": "use bf16", "status": "verified", "fix": "bf16"},
                          {"snapshot": "run/s7.pt", "text": "use bf16 there", "status": "verified", "fix": "bf16"}]}
    text = _text(write_autopsy_html(tmp_path / "p.html", autopsy, report=small_report, replays=[],
                                    run_dir=tmp_path))
    # the answer's replay first, each list under its own step, neither list holding the other's fixes
    first, second = text.index("step 40 (s40.pt)"), text.index("step 7 (s7.pt)")
    assert first < text.index("verified: fix bf16 on run/s40.pt") < text.index("fails: fix upcast on run/s40.pt") \
        < text.index("verified: use bf16") < second < text.index("fails: fix bf16 on run/s7.pt")
    assert "use bf16 there" not in text  # its fix failed on its own step
    assert "verified: use bf16" in text[first:second]  # bf16 failing at step 7 does not hide step 40's advice


def test_one_figure_per_distinct_culprit_keyed_by_the_first_snapshot_of_each():
    from types import SimpleNamespace

    from analyzer.render.autopsy_html import _figure_groups

    r = {n: SimpleNamespace(snapshot=n) for n in ("a", "b", "c", "d", "e")}
    # b and d blame a's op (d through b), e blames c's; the primary b heads the answer before a
    shared = {"shared_fixes": [{"snapshot": "b", "same_culprit_as": "a"}, {"snapshot": "d", "same_culprit_as": "b"},
                               {"snapshot": "e", "same_culprit_as": "c"}]}
    groups = _figure_groups([r["b"], r["a"], r["c"], r["d"], r["e"]], shared)
    assert [(g.snapshot, [x.snapshot for x in later]) for g, later in groups] == [("b", ["a", "d"]), ("c", ["e"])]
    assert [(g.snapshot, later) for g, later in _figure_groups([r["a"], r["c"]], {})] == [("a", []), ("c", [])]

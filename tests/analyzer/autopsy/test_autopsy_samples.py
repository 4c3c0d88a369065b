"""Slow end to end: ``analyzer autopsy`` on each of the eight recorded sample runs (samples/).

The runs are the session's shared recordings (``tests.sample_runs``: each trains once). Each
autopsy must give the verdict and culprit that ``analyzer replay`` gives on the sample's first
snapshot (tests/analyzer/replay/test_replay_samples.py pins them, and each sample's docstring
argues why they are right); the three samples that never fail have no failure snapshot, and
their answer comes from the report alone.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from analyzer.autopsy import run_autopsy
from analyzer.render import render_autopsy_text
from samples._common import snapshots_of
from tests.sample_runs import FAILING_SAMPLES, sample_run

pytestmark = pytest.mark.slow

_AUTOPSIES: dict[str, object] = {}


def _autopsy(factory, sample: str):
    """One autopsy per sample per session (each tries its fixes: several replays of a real model)."""
    if sample not in _AUTOPSIES:
        _AUTOPSIES[sample] = run_autopsy(sample_run(factory, sample), device="cpu")
    return _AUTOPSIES[sample]


def _refuse(name):
    raise ValueError(name)


@pytest.mark.parametrize("sample, step, verdict, op, module", FAILING_SAMPLES + [
    # never fail: no failure snapshot (healthy's one snapshot is a manual one), a report-only answer
    ("stalled_layers", None, "healthy", None, None),
    ("loss_outside_autocast", None, "healthy", None, None),
    ("healthy", None, "healthy", None, None),
])
def test_each_sample_autopsy_prints_its_documented_verdict_and_culprit_first(tmp_path_factory, sample, step,
                                                                            verdict, op, module):
    a = _autopsy(tmp_path_factory, sample)
    text = render_autopsy_text(a)
    head = text.splitlines()
    assert head[1] == f"verdict: {verdict}" and a.verdict == verdict
    out = a.to_dict()
    json.loads(json.dumps(out, allow_nan=False), parse_constant=_refuse)
    if step is None:
        assert a.replays == () and out["culprit"] is None and out["fixes"] == []
        assert head[3].startswith("  root cause: no failing step: the run wrote no failure snapshot, so nothing "
                                  "was replayed; the report says ")
        return
    first = snapshots_of(sample_run(tmp_path_factory, sample))[0]
    assert a.primary.snapshot == str(first) and first.name.startswith(f"step{step:08d}-")
    assert (out["culprit"]["op"], out["culprit"]["module"]) == (op, module)
    assert head[3].startswith(f"  root cause: {verdict}: ")
    assert head[4].startswith(f"  where: {op} in {module} ") and f", step {step}, rank 0 ({first.name})" in head[4]
    # every fix tried is reported with a status; a failing one is never worded as a recommendation
    failing = {f.title for _, f in a.fixes if f.status == "fails"}
    answer = text[:text.index("evidence 1/")]
    assert all(f"verified fix: {t}" not in answer for t in failing)
    assert {f.status for _, f in a.fixes} <= {"verified", "fails", "not_tried"}


def test_the_healthy_samples_manual_snapshot_is_named_but_not_replayed(tmp_path_factory):
    a = _autopsy(tmp_path_factory, "healthy")
    manual = snapshots_of(sample_run(tmp_path_factory, "healthy"))[-1]
    assert manual.name.endswith("-manual.pt") and a.picked == ()
    assert f"to replay one: analyzer replay {manual}" in "\n".join(a.answer())


def test_bf16_and_attention_in_fp32_verify_on_the_fp16_attention_overflow(tmp_path_factory):
    # BF16 has FP32's range: the logit that overflowed FP16 (about 3.4e5) fits, on every CPU.
    a = _autopsy(tmp_path_factory, "fp16_attention_overflow")
    status = {f.name: f.status for s, f in a.fixes if s == a.primary.snapshot}
    assert status.get("bf16") == "verified", status
    # Every attention module kept in FP32 (the second block's overflows too once the first's is fixed).
    assert status.get("module_fp32") == "verified", status
    # The later overflow_streak and scale_collapse snapshots blame the same op: replayed, fixes shared.
    assert [Path(s).name.split("-")[-1] for s, _ in a.shared] == ["overflow_streak.pt", "scale_collapse.pt"]

"""pick_snapshots: the earliest failure of each rank and of each trigger kind, never a manual snapshot."""
from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from analyzer.autopsy import pick_snapshots
from analyzer.load.run_dir import snapshot_info
from recorders import schema

REASONS = ("nonfinite_loss", "nonfinite_grads", "scale_collapse", "overflow_streak", "peer_failure", "manual")


def _infos(names: list[str]) -> list[dict]:
    """Snapshot descriptions as the report lists them, parsed from real file names."""
    return [snapshot_info(Path("run") / schema.SNAPSHOT_DIR / n) for n in names]


def test_one_rank_with_three_trigger_kinds_picks_the_earliest_of_each_kind_in_step_order():
    # The demo run's three snapshots (tests/test_demo.py records them): one per trigger kind.
    names = [schema.snapshot_name(37, 0, "scale_collapse"), schema.snapshot_name(24, 0, "nonfinite_loss"),
             schema.snapshot_name(31, 0, "overflow_streak"), schema.snapshot_name(40, 0, "nonfinite_loss")]
    picked = pick_snapshots(_infos(names))
    assert [(p["step"], p["reason"]) for p in picked] == [(24, "nonfinite_loss"), (31, "overflow_streak"),
                                                         (37, "scale_collapse")]
    assert picked[0]["why"] == "first failure of rank 0; first nonfinite_loss"
    assert picked[1]["why"] == "first overflow_streak"


def test_two_failing_ranks_get_one_snapshot_each_and_rank_restricts_to_one():
    names = [schema.snapshot_name(2, 0, "peer_failure"), schema.snapshot_name(2, 1, "nonfinite_loss"),
             schema.snapshot_name(3, 1, "nonfinite_loss")]
    assert [(p["step"], p["rank"]) for p in pick_snapshots(_infos(names))] == [(2, 0), (2, 1)]
    assert [(p["step"], p["rank"]) for p in pick_snapshots(_infos(names), rank=1)] == [(2, 1)]


def test_manual_snapshots_and_unparsable_names_are_never_picked():
    infos = _infos([schema.snapshot_name(59, 0, "manual")]) + [snapshot_info(Path("run/snapshots/notes.pt"))]
    assert pick_snapshots(infos) == []


_snapshot = st.builds(lambda step, rank, reason: schema.snapshot_name(step, rank, reason),
                      st.integers(0, 50), st.integers(0, 3), st.sampled_from(REASONS))


@settings(max_examples=200, deadline=None)
@given(st.lists(_snapshot, max_size=12, unique=True), st.one_of(st.none(), st.integers(0, 3)))
def test_every_rank_and_kind_has_its_earliest_failure_picked_and_nothing_else(names, rank):
    infos = _infos(names)
    picked = pick_snapshots(infos, rank=rank)
    failing = [i for i in infos if i["reason"] != "manual" and (rank is None or i["rank"] == rank)]
    files = [p["file"] for p in picked]
    assert len(files) == len(set(files))
    assert all(p["reason"] != "manual" and (rank is None or p["rank"] == rank) for p in picked)
    assert [(p["step"], p["rank"]) for p in picked] == sorted((p["step"], p["rank"]) for p in picked)
    firsts = set()
    for key in ("rank", "reason"):
        for value in {i[key] for i in failing}:
            group = [i for i in failing if i[key] == value]
            first = min(group, key=lambda i: (i["step"], i["rank"], i["file"]))
            assert first["file"] in files, (key, value)
            firsts.add(first["file"])
    # Each pick is the first of its rank or the first of its kind: nothing else is replayed.
    assert set(files) == firsts

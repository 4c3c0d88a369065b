"""SnapshotInfo: what a snapshot's file name says, a frozen value whose JSON is the snapshot entry
``report --json`` and ``autopsy --json`` print."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzer.autopsy import pick_snapshots
from analyzer.load import SnapshotInfo, snapshot_info
from recorders import schema

_KEYS = ["file", "step", "rank", "reason", "writer"]
_reason = st.text(st.characters(codec="ascii", categories=("L", "N"), include_characters="_"), min_size=1, max_size=20)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**9), st.integers(0, 99999), st.integers(0, 5), _reason)
def test_a_recorder_file_name_reads_back_as_the_values_it_was_named_from(step, rank, writer, reason):
    path = Path("run") / schema.SNAPSHOT_DIR / schema.snapshot_name(step, rank, reason, writer)
    info = snapshot_info(path)
    assert (info.file, info.step, info.rank, info.reason, info.writer) == (str(path), step, rank, reason, writer)
    d = info.to_dict()
    assert list(d) == _KEYS and json.loads(json.dumps(d)) == d  # the report's JSON entry, keys in this order
    assert SnapshotInfo(**d) == info and all(info[k] == d[k] for k in _KEYS)


_near_miss = st.from_regex(r"step[0-9]{0,3}-r[0-9]{0,2}(-w[0-9]?)?-?[a-z_]{0,4}(\.pt)?", fullmatch=True)


@settings(max_examples=200, deadline=None)
@given(st.one_of(_near_miss, st.text(max_size=30).map(lambda t: t + ".pt")))
def test_a_name_reads_as_the_file_name_pattern_says_and_as_nothing_known_otherwise(name):
    path = Path("run") / schema.SNAPSHOT_DIR / (name.replace("/", "_").replace("\0", "_") or "_")
    info, m = snapshot_info(path), schema.SNAPSHOT_RE.match(path.name)
    if m is None:
        assert info.to_dict() == {"file": str(path), "step": None, "rank": None, "reason": None, "writer": None}
    else:
        assert (info.step, info.rank, info.writer, info.reason) == (int(m[1]), int(m[2]), int(m[3] or 0), m[4])


def test_a_picked_snapshot_carries_why_in_its_json_and_stays_frozen():
    infos = [snapshot_info(Path("run/snapshots") / schema.snapshot_name(7, 1, schema.NONFINITE_LOSS))]
    [picked] = pick_snapshots(infos)
    assert picked.to_dict() == {**infos[0].to_dict(), "why": "first failure of rank 1; first nonfinite_loss"}
    assert infos[0].why is None and "why" not in infos[0].to_dict()  # the report's entry is left as it was
    with pytest.raises(dataclasses.FrozenInstanceError):
        picked.step = 8  # type: ignore[misc]
    with pytest.raises(KeyError):
        infos[0]["why"]

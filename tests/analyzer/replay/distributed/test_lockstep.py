"""What the ranks of a distributed replay send each other in lockstep (``distributed.lockstep``) survives the trip.

A rank's ``Snapshot`` and ``ReplayResult`` are pickled (``DistGroup.share``); the result's records mark the
fields that do not apply with the one ``records.UNSET``, which ``--json`` leaves out by identity. The
end-to-end runs are in ``tests/test_distributed_lockstep.py``.
"""
from __future__ import annotations

import pickle

from analyzer.load import load_snapshot
from analyzer.replay import Replay
from analyzer.replay.result.records import UNSET


def test_a_pickled_snapshot_loads_back_with_its_raw_entries_and_fields(log_zero_step):
    snap = load_snapshot(log_zero_step)
    back = pickle.loads(pickle.dumps(snap))
    assert dict(back).keys() == dict(snap).keys() and back["reason"] == snap.reason
    assert (back.step, back.reason, back.factory, back.loss_fn) == (snap.step, snap.reason, snap.factory, snap.loss_fn)
    assert back.batch.keys() == snap.batch.keys()


def test_a_pickled_replay_result_gives_the_same_json_as_the_one_it_was_made_from(log_zero_step):
    assert pickle.loads(pickle.dumps(UNSET)) is UNSET
    result = Replay(log_zero_step).run()
    back = pickle.loads(pickle.dumps(result))
    assert back.to_dict() == result.to_dict()
    assert "zeros" not in back.to_dict()["culprit"]  # an UNSET field stays out of the JSON after the trip

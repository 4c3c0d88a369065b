"""A spike snapshot's ``spike`` entry (format 7) is checked at load: the recorder's measurement, or one
``BadInputError`` naming the file and the key; never a value carried on unread."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.errors import BadInputError
from analyzer.load import load_snapshot
from recorders import schema
from recorders.snapshot import write_snapshot

from ...hostile_corpus import snapshot_dict

REAL = {"reason": "loss_spike", "metric": "loss", "value": 40.1, "baseline": 2.3, "ratio": 17.4, "spread": 0.05,
        "threshold": 6.9, "factor": 3.0, "z": 7.0, "window": 100}  # what recorders/_spikes.py writes


def test_the_recorders_measurement_loads_as_it_was_written(tmp_path):
    snap = load_snapshot(write_snapshot(tmp_path / "s.pt", snapshot_dict(spike=REAL)))
    assert snap.spike == REAL


@pytest.mark.parametrize("spike", [[1, 2], {"value": "x" * 100}, {"other": 1.0}, {"value": [1.0]}, {"z": True}, 3.0])
def test_a_spike_entry_of_another_shape_is_refused_naming_the_key(tmp_path, spike):
    path = write_snapshot(tmp_path / "s.pt", snapshot_dict(spike=spike))
    with pytest.raises(BadInputError, match="snapshot 'spike' should be None or a dict of reason, metric"):
        load_snapshot(path)


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=80),
                    st.lists(st.floats(), max_size=2))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spike=st.one_of(st.none(), _VALUES, st.dictionaries(st.sampled_from(schema.SPIKE_KEYS + ("x",)), _VALUES,
                                                          max_size=len(schema.SPIKE_KEYS) + 1)))
def test_any_spike_entry_loads_or_gives_one_bad_input_error(tmp_path_factory, spike):
    path = write_snapshot(tmp_path_factory.mktemp("s") / "s.pt", snapshot_dict(spike=spike))
    try:
        snap = load_snapshot(path)
    except BadInputError as e:
        assert "'spike'" in str(e) and "\n" not in str(e)
        return
    assert repr(snap.spike) == repr(spike)  # repr: NaN equals itself there

"""A snapshot's ``micro_batches`` entry (format 6) read from a file: a valid one loads as written, any other
value is one ``BadInputError`` naming the key, never another exception."""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.errors import BadInputError
from analyzer.load import load_snapshot
from recorders import schema
from tests.analyzer.load.test_snapshot import _snapshot


def _valid(count: int) -> dict:
    return {"count": count, "combine": "mean", "divisor": float(count), "source": "list", "num_items_in_batch": None}


def _batch(count: int) -> list[dict]:
    return [{"x": torch.randn(2, 4)} for _ in range(count)]


def test_a_written_entry_loads_back_as_written(tmp_path):
    path, _ = _snapshot(tmp_path, batch=_batch(3), micro_batches=_valid(3))
    snap = load_snapshot(path)
    assert snap.micro_batches == _valid(3) and len(snap.batch) == 3


def test_an_older_snapshot_has_no_entry(tmp_path):
    path, _ = _snapshot(tmp_path, format_version=5)
    raw = torch.load(path, weights_only=True)
    del raw["micro_batches"]
    torch.save(raw, path)
    assert load_snapshot(path).micro_batches is None


_values = st.one_of(st.none(), st.booleans(), st.integers(-3, 5), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=80), st.sampled_from(list(schema.MICRO_BATCH_COMBINES)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(schema.MICRO_BATCH_KEYS), value=_values, count=st.integers(1, 3),
       held=st.integers(0, 4))
def test_any_entry_loads_or_is_one_bad_input_error_naming_the_key(field, value, count, held):
    entry = {**_valid(count), field: value}
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = _snapshot(Path(tmp), batch=_batch(held), micro_batches=entry)
        try:
            snap = load_snapshot(path)
        except BadInputError as e:
            assert "'micro_batches'" in str(e)
            return
    # what loads is what the reader promises replay: a list of `count` micro-batches, a usable divisor
    mb = snap.micro_batches
    assert mb["count"] == len(snap.batch) >= 1 and mb["combine"] in schema.MICRO_BATCH_COMBINES
    assert math.isfinite(mb["divisor"]) and mb["divisor"] > 0


@pytest.mark.parametrize("entry, batch, match", [
    ({"count": 2}, _batch(2), "must be a dict with keys"),
    ({**_valid(2), "count": 3}, _batch(2), "count is 3 but the batch is a list of 2"),
    (_valid(2), {"x": torch.randn(2)}, "the batch is a dict"),
    ({**_valid(2), "divisor": 0.0}, _batch(2), "divisor 0.0 is not a positive finite number"),
    ({**_valid(2), "combine": "median"}, _batch(2), "combine 'median' is not one of"),
])
def test_a_bad_entry_names_what_is_wrong(tmp_path, entry, batch, match):
    path, _ = _snapshot(tmp_path, batch=batch, micro_batches=entry)
    with pytest.raises(BadInputError, match=match):
        load_snapshot(path)

"""The exception entry of meta.json and snapshots (format 4) is read from untrusted files."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from analyzer.load.exceptions import raised_text, read_exception
from recorders import schema

_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=12)
_ENTRY = st.fixed_dictionaries({"type": _JSON | st.text(max_size=30), "message": _JSON | st.text(max_size=30)},
                               optional={"frames": _JSON | st.lists(st.text(max_size=30), max_size=5),
                                         "step": _JSON, "last_step": _JSON, "failure": _JSON})


@settings(max_examples=300, deadline=None)
@given(st.one_of(_JSON, _ENTRY))
def test_any_json_value_is_read_as_an_entry_or_refused_with_one_value_error(value):
    try:
        entry = read_exception(value)
    except ValueError:
        return
    if entry is None:
        assert value is None
        return
    assert tuple(entry) == schema.EXCEPTION_KEYS
    assert isinstance(entry["type"], str) and isinstance(entry["message"], str)
    assert all(isinstance(f, str) for f in entry["frames"])
    assert entry["step"] is None or isinstance(entry["step"], int) and not isinstance(entry["step"], bool)
    line = raised_text(entry)
    assert "\n" not in line and line.startswith(" ".join(entry["type"].split())[:200])


def test_raised_text_names_the_innermost_user_frame_not_torchs():
    entry = read_exception({"type": "RuntimeError", "message": "The total norm\nis non-finite", "step": 5,
                            "frames": ["train.py:42 in main: clip_grad_norm_(ps, 1.0, error_if_nonfinite=True)",
                                       "/venv/lib/site-packages/torch/nn/utils/clip_grad.py:110 in _get_total_norm"]})
    assert raised_text(entry) == ("RuntimeError: The total norm is non-finite (at train.py:42 in main: "
                                  "clip_grad_norm_(ps, 1.0, error_if_nonfinite=True))")

"""The JSON reader's limit on integer length: the fast path and the checked one agree."""
from __future__ import annotations

import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from analyzer.load._limits import MAX_JSON_DIGITS, NumberTooLong, json_int, json_loads

_long_ints = st.integers(min_value=MAX_JSON_DIGITS - 3, max_value=MAX_JSON_DIGITS + 3).flatmap(
    lambda n: st.sampled_from([10 ** (n - 1), -(10 ** n - 1), int("7" * n)]))  # n digits, either sign
_values = st.recursive(
    st.none() | st.booleans() | st.integers() | _long_ints | st.floats()
    | st.text(alphabet=st.sampled_from("0123456789é-. a"), max_size=MAX_JSON_DIGITS + 5),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3), max_leaves=6)


def _outcome(read, text):
    try:
        return "read", repr(read(text))
    except NumberTooLong as e:
        return "refused", str(e)


@given(value=_values, ascii_only=st.booleans())
@example(value=10 ** MAX_JSON_DIGITS, ascii_only=True)      # 101 digits: refused
@example(value=10 ** MAX_JSON_DIGITS - 1, ascii_only=True)  # 100 digits: read
@example(value="1" * (MAX_JSON_DIGITS + 1), ascii_only=True)  # a run of digits in a string: read
def test_json_loads_reads_or_refuses_exactly_as_the_per_integer_check(value, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert _outcome(json_loads, text) == _outcome(lambda t: json.loads(t, parse_int=json_int), text)


def test_an_integer_one_digit_too_long_is_refused_with_its_length():
    with pytest.raises(NumberTooLong, match=f"holds a number with {MAX_JSON_DIGITS + 1} digits"):
        json_loads(json.dumps({"numel": 10 ** MAX_JSON_DIGITS}))

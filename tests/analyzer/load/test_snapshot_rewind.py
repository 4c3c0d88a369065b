"""A snapshot's ``rewind`` entry (format 8) is checked at load: the Recorder's window, or one ``BadInputError``
naming the file and the entry; never a value the window replay would trip over."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.errors import BadInputError
from analyzer.load import load_snapshot
from recorders import schema
from recorders.snapshot import write_snapshot

from ...hostile_corpus import snapshot_dict


def _step(step: int, last: bool) -> dict:
    s = {"step": step, "batch": {"x": torch.randn(2, 3), "y": torch.randn(2, 2)}, "micro_batches": None,
         "rng": {"cpu": torch.get_rng_state(), "cuda": None}, "loss": 0.5, "scale": None, "skipped": False,
         "grad_norm": 1.0, "lr": 1e-3, "optimizer_stepped": None if last else True,
         "param_groups": None if last else [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "foreach": None}]}
    assert tuple(s) == schema.REWIND_STEP_KEYS
    return s


def _entry() -> dict:
    """The shape recorders/_rewind.py writes: a window of steps 1..3 ending at snapshot_dict's step 3."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return {"steps_asked": 2, "start_step": 1, "model_state": model.state_dict(),
            "optimizer": {"class": "torch.optim.adam.Adam", "state_dict": opt.state_dict(),
                          "param_names": ["weight", "bias"]},
            "steps": [_step(i, i == 3) for i in (1, 2, 3)]}


def _write(tmp_path, rewind) -> str:
    return str(write_snapshot(tmp_path / "s.pt", snapshot_dict(rewind=rewind)))


def test_the_recorders_window_loads_as_it_was_written(tmp_path):
    snap = load_snapshot(_write(tmp_path, _entry()))
    assert snap.rewind["start_step"] == 1 and [s["step"] for s in snap.rewind["steps"]] == [1, 2, 3]
    assert snap.rewind["steps"][0]["param_groups"][0]["betas"] == (0.9, 0.999)


def _with(path_value):
    def make():
        e = _entry()
        *where, key = path_value[0]
        obj = e
        for k in where:
            obj = obj[k]
        if path_value[1] is KeyError:
            del obj[key]
        else:
            obj[key] = path_value[1]
        return e
    return make


_BAD = {
    "not a dict": lambda: 3,
    "a key missing": _with((["steps_asked"], KeyError)),
    "steps_asked 0": _with((["steps_asked"], 0)),
    "no steps": _with((["steps"], [])),
    "steps a dict": _with((["steps"], {})),
    "a step of another snapshot": _with((["steps", 2, "step"], 4)),
    "steps out of order": _with((["steps", 1, "step"], 0)),
    "a text loss": _with((["steps", 0, "loss"], "0.5")),
    "a NaN scale": _with((["steps", 0, "scale"], float("nan"))),
    "skipped 1": _with((["steps", 0, "skipped"], 1)),
    "a truncated step": _with((["steps", 1, "rng"], KeyError)),
    "a foreign rng": _with((["steps", 1, "rng"], {"cpu": torch.zeros(3, dtype=torch.uint8)})),
    "a stride-0 batch": _with((["steps", 0, "batch"], {"x": torch.zeros(1).expand(10**9)})),
    "no optimizer": _with((["optimizer"], None)),
    "an optimizer without state": _with((["optimizer", "state_dict"], {"param_groups": []})),
    "text hyperparameters": _with((["steps", 0, "param_groups"], [{"lr": "high"}])),
    "empty model_state": _with((["model_state"], {})),
    "a model_state of numbers": _with((["model_state"], {"weight": 1.0})),
}


@pytest.mark.parametrize("name", sorted(_BAD))
def test_a_window_no_recorder_writes_is_refused_naming_the_file_and_the_entry(tmp_path, name):
    path = _write(tmp_path, _BAD[name]())
    with pytest.raises(BadInputError) as e:
        load_snapshot(path)
    text = str(e.value)
    assert text.startswith(f"{path}: ") and "rewind" in text.removeprefix(path) and "\n" not in text


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=20),
                    st.lists(st.floats(), max_size=3), st.dictionaries(st.text(max_size=5), st.floats(), max_size=2))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from([("",) + (k,) for k in schema.REWIND_KEYS]
                             + [("steps", i, k) for i in (0, 2) for k in schema.REWIND_STEP_KEYS]),
       value=_VALUES, drop=st.booleans())
def test_any_changed_field_of_the_window_loads_or_gives_one_bad_input_error(tmp_path_factory, where, value, drop):
    e = _entry()
    obj = e if where[0] == "" else e["steps"][where[1]]
    key = where[-1]
    if drop:
        del obj[key]
    else:
        obj[key] = value
    path = write_snapshot(tmp_path_factory.mktemp("s") / "s.pt", snapshot_dict(rewind=e))
    try:
        snap = load_snapshot(path)
    except BadInputError as err:
        text = str(err)
        assert text.startswith(f"{path}: ") and "rewind" in text.removeprefix(str(path)) and "\n" not in text
        return
    assert snap.rewind is not None and not drop  # a window missing a field never loads


def test_a_version_7_snapshot_without_the_key_loads_with_no_window(tmp_path):
    snap = snapshot_dict(format_version=7)
    del snap["rewind"]
    loaded = load_snapshot(write_snapshot(tmp_path / "s.pt", snap))
    assert loaded.format_version == 7 and loaded.rewind is None

"""``--factory-kwargs JSON``: the factory's keyword arguments from the command line, merged over the snapshot's,
applied to the loaded snapshot (recorded or a checkpoint with --batch); bad JSON is one ``Error:`` line."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzer.cli import main
from analyzer.errors import BadInputError
from analyzer.load.overrides import parse_factory_kwargs
from recorders.snapshot import build_snapshot, write_snapshot
from recorders import Recorder
from tests.recorders.models import build_mlp, mse_loss

REFS = ["--factory", "tests.recorders.models:build_mlp", "--loss-fn", "tests.recorders.models:mse_loss"]


def _cli(*args):
    return CliRunner().invoke(main, [*map(str, args)])


@pytest.fixture
def wide(tmp_path):
    """A width-16 MLP: its snapshot (factory_kwargs {"depth": 2}, width left out) and checkpoint + batch."""
    torch.manual_seed(0)
    model = build_mlp(width=16)
    batch = {"x": torch.randn(4, 16), "y": torch.randn(4, 1)}
    snap = build_snapshot(step=3, reason="manual", model=model, batch=batch, rng={"cpu": torch.get_rng_state(),
                          "cuda": None}, factory="tests.recorders.models:build_mlp", factory_kwargs={"depth": 2},
                          loss_fn="tests.recorders.models:mse_loss", amp_dtype=torch.bfloat16, device_type="cpu")
    write_snapshot(tmp_path / "s.pt", snap)
    torch.save(model.state_dict(), tmp_path / "m.pt")
    torch.save(batch, tmp_path / "b.pt")
    return tmp_path


def test_a_snapshot_whose_recorded_kwargs_miss_one_replays_with_it_given(wide):
    without = _cli("replay", wide / "s.pt", "--json")
    assert without.exit_code == 1 and "do not fit the model built by" in without.output, without.output
    res = _cli("replay", wide / "s.pt", "--json", "--factory-kwargs", '{"width": 16}')
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["verdict"] == "healthy"


def test_a_checkpoint_replays_and_autopsies_with_the_factorys_kwargs_named_in_its_notes(wide):
    for command in ("replay", "autopsy"):
        res = _cli(command, wide / "m.pt", "--batch", wide / "b.pt", *REFS, "--amp", "bf16", "--json",
                   "--factory-kwargs", '{"width": 16}')
        assert res.exit_code == 0, (command, res.output)
    out = json.loads(_cli("replay", wide / "m.pt", "--batch", wide / "b.pt", *REFS, "--amp", "bf16", "--json",
                          "--factory-kwargs", '{"width": 16}').output)
    assert "factory keyword arguments from --factory-kwargs (width)" in out["checkpoint"]["notes"]


@pytest.mark.parametrize("text, says", [
    ("{width: 16}", "--factory-kwargs is not valid JSON (Expecting property name enclosed in double quotes at "
                    "character 1)"),
    ("[16]", "--factory-kwargs is a JSON array, not an object"),
    ('"width=16"', "--factory-kwargs is a JSON string, not an object"),
    ('{"w": NaN}', "--factory-kwargs is not valid JSON (NaN is not JSON)"),
    ("[" * 100_000, "--factory-kwargs is not valid JSON"),
])
@pytest.mark.parametrize("command", ["replay", "autopsy"])
def test_bad_factory_kwargs_are_one_error_line_saying_what_to_pass(wide, command, text, says):
    res = _cli(command, wide / "m.pt", "--batch", wide / "b.pt", *REFS, "--factory-kwargs", text)
    assert res.exit_code == 1, res.output
    [line] = res.output.strip().splitlines()
    assert line.startswith(f"Error: {says}") and "pass a JSON object of the factory's keyword arguments" in line, line


def test_autopsy_of_a_run_directory_replays_its_snapshots_with_the_factory_kwargs_given(tmp_path):
    # a run whose recorded kwargs leave the width out: its snapshot replays only with it given
    torch.manual_seed(0)
    model = build_mlp(width=16)
    with Recorder(tmp_path / "run", model, factory="tests.recorders.models:build_mlp", factory_kwargs={"depth": 2},
                  loss_fn="tests.recorders.models:mse_loss") as rec:
        for step in range(3):
            batch = {"x": torch.randn(4, 16), "y": torch.randn(4, 1)}
            if step == 2:
                batch["x"][0, 0] = float("nan")  # a bad record: the step's loss is NaN
            rec.begin_step(step, batch)
            mse_loss(model, batch).backward()
            rec.end_step(mse_loss(model, batch).detach())
    without = _cli("autopsy", tmp_path / "run", "--json")
    assert without.exit_code == 1 and "do not fit the model built by" in without.output, without.output
    res = _cli("autopsy", tmp_path / "run", "--json", "--factory-kwargs", '{"width": 16}')
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["verdict"] == "nonfinite_input" and out["culprit"]["input"] == "batch:x"


@settings(max_examples=80, deadline=None)
@given(text=st.text(max_size=40) | st.recursive(st.none() | st.integers() | st.text(max_size=4),
                                                lambda c: st.lists(c, max_size=3)
                                                | st.dictionaries(st.text(max_size=4), c, max_size=3)).map(json.dumps))
def test_any_text_is_a_dict_or_one_bad_input_error(text):
    try:
        out = parse_factory_kwargs(text)
    except BadInputError as e:
        assert str(e).startswith("--factory-kwargs ") and "\n" not in str(e)
        return
    assert isinstance(out, dict) and out == json.loads(text)


def test_show_with_factory_kwargs_is_a_usage_error_not_a_silent_ignore(wide):
    res = _cli("replay", wide / "s.pt", "--show", "--factory-kwargs", '{"width": 16}')
    assert res.exit_code == 2 and "--show prints what the snapshot names" in res.output, res.output

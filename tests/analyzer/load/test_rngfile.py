"""The RNG state of a failing step read from ``--rng FILE`` or a batch file's ``rng`` entry: the snapshot's
format, one reader, weights_only, and one ``Error:`` line for anything else (hypothesis for hostile files)."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.cli import main
from analyzer.errors import BadInputError
from analyzer.load.adhoc import load_checkpoint_snapshot
from analyzer.load.rngfile import MAX_RNG_FILE, load_rng_file, split_batch_rng
from tests.recorders.models import build_mlp

REFS = ["--factory", "tests.recorders.models:build_mlp", "--loss-fn", "tests.recorders.models:mse_loss"]


def _state(seed: int = 7) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


@pytest.fixture
def ckpt(tmp_path):
    torch.save(build_mlp().state_dict(), tmp_path / "m.pt")
    torch.save({"x": torch.ones(4, 8), "y": torch.zeros(4, 1)}, tmp_path / "b.pt")
    return tmp_path


@pytest.mark.parametrize("saved", [
    lambda s: {"cpu": s, "cuda": []},   # torch.cuda.get_rng_state_all() without a CUDA device
    lambda s: {"cpu": s, "cuda": None},  # the recorder snapshot's own form
    lambda s: {"cpu": s},
    lambda s: s,                         # torch.save(torch.get_rng_state(), FILE)
])
def test_every_saved_form_of_the_cpu_state_reads_as_the_snapshots_rng(tmp_path, saved):
    torch.save(saved(_state()), tmp_path / "rng.pt")
    rng = load_rng_file(tmp_path / "rng.pt")
    assert set(rng) == {"cpu", "cuda"} and rng["cuda"] is None and torch.equal(rng["cpu"], _state())


def test_the_rng_file_goes_where_a_recorded_snapshot_keeps_it(ckpt):
    torch.save({"cpu": _state(3), "cuda": []}, ckpt / "rng.pt")
    snap = load_checkpoint_snapshot(ckpt / "m.pt", ckpt / "b.pt", factory=REFS[1], loss_fn=REFS[3], rng=ckpt / "rng.pt")
    assert torch.equal(snap.rng["cpu"], _state(3)) and torch.equal(snap["rng"]["cpu"], _state(3))
    assert snap.source["rng"] == str(ckpt / "rng.pt") and snap.source["seed"] is None
    assert any(n.startswith(f"RNG state: {ckpt / 'rng.pt'} (--rng)") for n in snap.notes)
    assert not any("RNG state or" in n or "fixed seed" in n for n in snap.notes)


def test_an_rng_entry_beside_the_batch_is_read_from_the_batch_file(ckpt):
    torch.save({"batch": {"x": torch.ones(4, 8), "y": torch.zeros(4, 1)}, "rng": {"cpu": _state(5), "cuda": None}},
               ckpt / "br.pt")
    snap = load_checkpoint_snapshot(ckpt / "m.pt", ckpt / "br.pt", factory=REFS[1], loss_fn=REFS[3])
    assert torch.equal(snap.rng["cpu"], _state(5)) and set(snap.batch) == {"x", "y"}
    assert "RNG state: the batch file's 'rng' entry, so random ops draw what the failing step drew" in snap.notes


def test_without_an_rng_state_the_fixed_seed_is_named_and_how_to_save_one(ckpt):
    snap = load_checkpoint_snapshot(ckpt / "m.pt", ckpt / "b.pt", factory=REFS[1], loss_fn=REFS[3])
    assert torch.equal(snap.rng["cpu"], torch.Generator().manual_seed(0).get_state())
    assert "fixed seed (0)" in snap.notes[-1] and "pass --rng FILE" in snap.notes[-1]


def test_a_user_batch_that_only_has_a_key_named_rng_stays_a_batch():
    batch = {"x": torch.ones(2), "rng": torch.zeros(2)}
    assert split_batch_rng(batch, "b.pt") == (batch, None)


@pytest.mark.parametrize("bad, says", [
    ({"cpu": torch.zeros(10, dtype=torch.uint8)}, "'cpu' should be a uint8 tensor of 5056 bytes"),
    ({"cpu": _state().float()}, "'cpu' should be a uint8 tensor"),
    ({"cpu": torch.zeros(5056, dtype=torch.uint8)}, "'cpu' is not a CPU generator state"),
    ({"cpu": _state(), "cuda": [torch.zeros(2**17, dtype=torch.uint8)]}, "'cuda' should be None or a list"),
    ({"cpu": _state(), "cuda": "x"}, "'cuda' should be None or a list"),
    ({"state": _state()}, "is not an RNG state: a dict with keys 'state'"),
    ([_state()], "should be a dict with a 'cpu' generator state"),
    ({"batch": {"x": torch.ones(2)}, "rng": {"cpu": _state()}}, "holds a batch and its RNG state: pass it as --batch"),
])
def test_a_wrong_rng_file_is_one_error_line_naming_the_file(ckpt, bad, says):
    torch.save(bad, ckpt / "rng.pt")
    res = CliRunner().invoke(main, ["replay", str(ckpt / "m.pt"), "--batch", str(ckpt / "b.pt"), "--rng",
                                    str(ckpt / "rng.pt"), *REFS])
    assert res.exit_code == 1, res.output
    [line] = res.output.strip().splitlines()
    assert line.startswith(f"Error: {ckpt / 'rng.pt'}: ") and says in line, line


def test_a_huge_rng_file_is_refused_before_it_is_read(ckpt):
    (ckpt / "rng.pt").write_bytes(b"\0" * (MAX_RNG_FILE + 1))
    with pytest.raises(BadInputError, match="bytes, not an RNG state"):
        load_rng_file(ckpt / "rng.pt")


def test_a_truncated_rng_file_is_one_error_line(ckpt):
    torch.save({"cpu": _state(), "cuda": None}, ckpt / "rng.pt")
    data = (ckpt / "rng.pt").read_bytes()
    (ckpt / "rng.pt").write_bytes(data[: len(data) // 2])
    res = CliRunner().invoke(main, ["replay", str(ckpt / "m.pt"), "--batch", str(ckpt / "b.pt"), "--rng",
                                    str(ckpt / "rng.pt"), *REFS])
    assert res.exit_code == 1 and res.output.startswith(f"Error: {ckpt / 'rng.pt'}: "), res.output
    assert len(res.output.strip().splitlines()) == 1


def test_a_bad_rng_entry_in_the_batch_file_names_the_entry(ckpt):
    torch.save({"batch": {"x": torch.ones(4, 8), "y": torch.zeros(4, 1)}, "rng": {"cpu": torch.ones(3)}},
               ckpt / "br.pt")
    with pytest.raises(BadInputError, match="the batch file's 'rng' entry 'cpu' should be a uint8 tensor"):
        load_checkpoint_snapshot(ckpt / "m.pt", ckpt / "br.pt", factory=REFS[1], loss_fn=REFS[3])


@pytest.mark.parametrize("command", ["replay", "autopsy"])
def test_rng_without_batch_is_a_usage_error(ckpt, command):
    torch.save({"cpu": _state()}, ckpt / "rng.pt")
    res = CliRunner().invoke(main, [command, str(ckpt / "m.pt"), "--rng", str(ckpt / "rng.pt")])
    assert res.exit_code == 2 and "--rng" in res.output and "--batch" in res.output, res.output


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5)
    | st.builds(lambda n, d: torch.zeros(n, dtype=d), st.integers(0, 6000), st.sampled_from([torch.uint8, torch.float32]))
    | st.just(_state()),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(["cpu", "cuda", "batch", "rng", "x"]), c,
                                                        max_size=3),
    max_leaves=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(obj=_values)
def test_any_rng_file_is_a_state_or_one_bad_input_error(tmp_path_factory, obj):
    path = tmp_path_factory.mktemp("rng") / "rng.pt"
    torch.save(obj, path)
    try:
        rng = load_rng_file(path)
    except BadInputError as e:
        assert str(e).startswith(f"{path}: ") and "\n" not in str(e)
        return
    assert rng["cpu"].dtype == torch.uint8 and rng["cpu"].numel() == torch.get_rng_state().numel()

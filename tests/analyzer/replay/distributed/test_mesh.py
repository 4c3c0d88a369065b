"""``mesh.hsdp_mesh``: which recorded meshes the distributed replay rebuilds, and the one error for the others.

The snapshot's ``fsdp["mesh"]`` is read from a file: any value is either rebuilt (1-D: None; HSDP: its shape
and names) or refused with a ``BadInputError`` naming the fix, never another exception. The real HSDP runs
are in ``tests/test_distributed_hsdp.py``.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzer.errors import BadInputError
from analyzer.replay.distributed.mesh import hsdp_mesh

HSDP = {"device_type": "cpu", "shape": [2, 3], "dim_names": ["replicate", "shard"],
        "placements": ["replicate", "shard(0)"]}


def test_a_1d_mesh_or_none_is_rebuilt_over_every_rank():
    assert hsdp_mesh("s.pt", {"shape": [4], "dim_names": None, "placements": ["shard(0)"]}, 2) is None
    assert hsdp_mesh("s.pt", None, 2) is None


def test_an_hsdp_mesh_on_its_rank_count_is_rebuilt_with_its_shape_and_names():
    assert hsdp_mesh("s.pt", HSDP, 6) == ([2, 3], ["replicate", "shard"])
    # names init_device_mesh would refuse (repeated) are left out: they shape nothing HSDP does
    assert hsdp_mesh("s.pt", dict(HSDP, dim_names=["a", "a"]), 6) == ([2, 3], None)


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_an_hsdp_mesh_on_another_rank_count_names_the_count_it_needs(ranks):
    with pytest.raises(BadInputError) as e:
        hsdp_mesh("s.pt", HSDP, ranks)
    assert "HSDP on a 2x3 device mesh (replicate, shard)" in str(e.value) and "--nproc-per-node 6" in e.value.fix


@pytest.mark.parametrize("placements", [["shard(0)", "shard(1)"], ["shard(0)", "replicate"], None,
                                        ["replicate", "shard(0)", "shard(1)"]])
def test_a_2d_mesh_other_than_hsdps_is_refused_naming_the_one_process_replay(placements):
    with pytest.raises(BadInputError) as e:
        hsdp_mesh("s.pt", dict(HSDP, placements=placements), 6)
    assert "HSDP's 2-D mesh" in str(e.value) and "without torchrun" in e.value.fix


_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**12) | st.floats() | st.text(max_size=30),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                     max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(-1, 5), max_size=3) | _values,
       names=st.lists(st.sampled_from("ab"), max_size=3) | _values,
       placements=st.sampled_from([["replicate", "shard(0)"], ["shard(0)"], None]) | _values, ranks=st.integers(1, 16))
def test_any_recorded_mesh_is_rebuilt_or_one_bad_input_error(shape, names, placements, ranks):
    mesh = {"device_type": "cpu", "shape": shape, "dim_names": names, "placements": placements}
    try:
        got = hsdp_mesh("s.pt", mesh, ranks)
    except BadInputError as e:
        assert len(str(e)) <= 600 and e.fix
        return
    if got is not None:
        (r, s), got_names = got
        assert r * s == ranks and placements == ["replicate", "shard(0)"]
        assert got_names is None or (len(got_names) == 2 and len(set(got_names)) == 2)

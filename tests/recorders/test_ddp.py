"""The Recorder's ``ddp`` entry: what shapes DDP's gradient all-reduce, in meta.json and snapshots.

Real 2-rank DDP runs over gloo (``tests/ddp_runs.py``, one spawn); the reader (``analyzer.load.ddp``)
on hypothesis-generated entries and on a snapshot whose entry was tampered with.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzer.cli import main
from analyzer.load import load_snapshot
from analyzer.load.ddp import read_ddp
from recorders import schema

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _metas(run):
    return [json.loads(p.read_text()) for p in sorted(run.glob("meta*.json"))]


def _snaps(run):
    return [load_snapshot(p) for p in sorted((run / schema.SNAPSHOT_DIR).glob(schema.SNAPSHOT_GLOB))]


@pytest.mark.parametrize("name, hook, dtype", [
    ("compress", "fp16_compress_hook", "float16"),  # given the module inside DDP; the hook registered after
    ("wrapper", "allreduce_hook", None),            # given the DDP wrapper
    ("plain", None, None),                          # no hook: DDP's reducer, in the gradients' dtype
    ("builtin", "fp16_compress_hook", "float16"),   # the C++ FP16_COMPRESS hook: the same numerics
])
def test_meta_and_every_snapshot_name_the_builtin_hook_its_reduce_dtype_and_the_division_before_the_sum(
        ddp_runs, name, hook, dtype):
    metas, snaps = _metas(ddp_runs[name]), _snaps(ddp_runs[name])
    assert len(metas) == 2 and len(snaps) == 2  # both ranks: every snapshot of step 0
    for entry in [m["ddp"] for m in metas] + [s.ddp for s in snaps]:
        assert tuple(entry) == schema.DDP_KEYS
        assert (entry["comm_hook"], entry["reduce_dtype"], entry["divide"]) == (hook, dtype, "before")
        assert entry["world_size"] == 2 and entry["gradient_as_bucket_view"] is False
        assert entry["broadcast_buffers"] is True and entry["mixed_precision"] is None
    assert all(m["format_version"] == schema.FORMAT_VERSION == 9 for m in metas)


def test_a_hook_of_the_users_own_is_unknown_and_warned_once_per_rank_in_meta(ddp_runs):
    metas, snaps = _metas(ddp_runs["custom"]), _snaps(ddp_runs["custom"])
    for m in metas:
        assert m["ddp"]["comm_hook"] == "unknown" and m["ddp"]["divide"] is None
        assert m["ddp"]["comm_hook_name"] == "halve_then_allreduce"
        assert [w["kind"] for w in m["warnings"]] == ["ddp_comm_hook"]
    assert [s.ddp["comm_hook"] for s in snaps] == ["unknown", "unknown"]


def test_a_model_without_ddp_records_no_ddp_entry(tmp_path):
    from tests.recorders.models import batches, build_mlp, train

    from recorders import Recorder

    model = build_mlp()
    with Recorder(tmp_path, model, factory="tests.recorders.models:build_mlp",
                  loss_fn="tests.recorders.models:mse_loss") as rec:
        train(model, batches(1), rec=rec)
        rec.snapshot()
    assert json.loads((tmp_path / "meta.json").read_text())["ddp"] is None
    assert _snaps(tmp_path)[0].ddp is None


_values = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**64), st.floats(allow_nan=True),
                    st.text(max_size=400), st.sampled_from(schema.DDP_HOOKS + ("float16", "before")),
                    st.dictionaries(st.text(max_size=5), st.one_of(st.none(), st.text(max_size=9)), max_size=3))


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.dictionaries(st.sampled_from(schema.DDP_KEYS + ("other",)), _values), _values))
def test_the_ddp_reader_returns_every_key_or_raises_value_error_for_any_entry(entry):
    try:
        out = read_ddp(entry)
    except ValueError:
        return
    assert out is None or tuple(out) == schema.DDP_KEYS


def test_a_snapshot_with_a_tampered_ddp_entry_is_one_error_line_naming_it(ddp_runs, tmp_path):
    src = next((ddp_runs["compress"] / schema.SNAPSHOT_DIR).glob(schema.SNAPSHOT_GLOB))
    snap = torch.load(src, weights_only=True)
    snap["ddp"]["comm_hook"] = "__import__('os')"
    bad = tmp_path / src.name
    torch.save(snap, bad)
    res = CliRunner().invoke(main, ["replay", str(bad)])
    lines = [x for x in res.output.splitlines() if x.startswith("Error:")]
    assert res.exit_code != 0 and len(lines) == 1 and "ddp" in lines[0] and "comm_hook" in lines[0], res.output


def test_a_format_8_snapshot_without_the_ddp_key_loads_with_ddp_none(ddp_runs, tmp_path):
    src = next((ddp_runs["plain"] / schema.SNAPSHOT_DIR).glob(schema.SNAPSHOT_GLOB))
    snap = torch.load(src, weights_only=True)
    del snap["ddp"]
    snap["format_version"] = 8
    torch.save(snap, tmp_path / src.name)
    assert load_snapshot(tmp_path / src.name).ddp is None

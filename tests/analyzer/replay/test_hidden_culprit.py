"""A forward NaN/Inf that a later op hid and backward surfaced: ``--json``'s culprit is the forward op the answer
leads with, in ``replay`` and ``autopsy`` alike, and the backward op that failed the step is its ``surfaced_at``.

The step is real: ``where_log_loss`` takes ``log(0)`` for a zero weight, ``torch.where`` hides the ``-inf`` from the
loss, and the log's backward divides by that zero (``replay_models.py``).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from analyzer.cli import main

from . import replay_models as rm


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hidden")
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(4, 4, generator=g), "w": torch.tensor([[1.0], [0.0], [1.0], [1.0]])}
    rm.record_step(out, factory="build_mlp", loss_fn="where_log_loss", batch=batch, amp_dtype=torch.float16)
    return out


def _invoke(*args: str):
    res = CliRunner().invoke(main, list(args))
    assert res.exit_code == 0, res.output
    return res.output


def test_replay_json_names_the_forward_log_as_the_culprit_and_the_backward_div_as_where_it_surfaced(run_dir):
    [snap] = (run_dir / "snapshots").glob("*.pt")
    out = json.loads(_invoke("replay", str(snap), "--json"))
    c = out["culprit"]
    assert out["verdict"] == "numerical_bug" and out["summary"].startswith("First, aten.log")
    assert (c["op"], c["phase"], c["output_kind"]) == ("aten.log", "forward", "inf")
    s = c["surfaced_at"]
    assert (s["op"], s["phase"], s["node"], s["output_kind"]) == ("aten.div", "backward", "LogBackward0", "nan")
    assert "hidden" not in s and s["shadow"] is not None  # the diagnosis' own culprit, its evidence kept
    # the log is first in time; the div is where the FP32 run first went non-finite
    assert c["index"] < s["index"] == out["runs"]["float32"]["first_nonfinite"]["index"]
    assert out["hidden_nonfinite"]["index"] == c["hidden"]["index"] == c["index"]
    assert c["index"] in [o["index"] for o in out["context_ops"]]


def test_autopsy_json_gives_the_same_culprit_as_replay_and_its_text_leads_with_the_log(run_dir):
    out = json.loads(_invoke("autopsy", str(run_dir), "--json"))
    c = out["culprit"]
    assert c == out["replays"][0]["culprit"]
    assert (c["op"], c["phase"], c["surfaced_at"]["op"], c["surfaced_at"]["phase"]) == (
        "aten.log", "forward", "aten.div", "backward")
    text = _invoke("replay", str(next((run_dir / "snapshots").glob("*.pt"))))
    block = text.split("\nculprit:\n")[1].split("\n\n")[0]
    assert block.splitlines()[0].split() == ["op", "aten.log.default"]
    assert "  surfaced  aten.div in `<loss_fn>`" in block and "(backward, LogBackward0)" in block
    assert "  hidden " not in block  # the hidden op is the culprit itself


def test_a_culprit_nothing_hid_has_no_surfaced_at(tmp_path):
    # p(class 2) = exp(-40) flushes to 0 in FP16 and the forward log of it reaches the loss: nothing hides it
    batch = {"x": torch.tensor([[2.0, 0, 0, 0], [1.0, 0, 0, 0]]), "y": torch.tensor([2, 0])}
    rm.record_step(tmp_path, factory="build_classifier", loss_fn="log_prob_loss", batch=batch,
                   amp_dtype=torch.float16, factory_kwargs={"gain": 10.0})
    [snap] = (tmp_path / "snapshots").glob("*.pt")
    c = json.loads(_invoke("replay", str(snap), "--json"))["culprit"]
    assert (c["op"], c["phase"]) == ("aten.log", "forward") and "surfaced_at" not in c


def test_the_replay_figure_marks_the_forward_log_as_the_culprit_and_the_backward_div_where_it_surfaced(run_dir):
    from analyzer.render.plots import plt
    from analyzer.render.replay import replay_figure
    from analyzer.replay import replay_snapshot

    r = replay_snapshot(next((run_dir / "snapshots").glob("*.pt")))
    fig = replay_figure(r)
    try:
        lines = {gid: [a for ax in fig.axes for a in ax.lines if a.get_gid() == gid] for gid in ("culprit", "surfaced_at")}
        at = {gid: {float(a.get_xdata()[0]) for a in found} for gid, found in lines.items()}
    finally:
        plt.close(fig)
    assert at == {"culprit": {float(r.hidden_nonfinite["index"])}, "surfaced_at": {float(r.culprit["index"])}}

"""``inspect --json`` lists the worst tensors of a file, at most JSON_TENSORS, and says how many it left
out; ``--all-tensors`` lists every one."""
from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from analyzer.cli import main
from analyzer.inspect import JSON_TENSORS


def _inspect(*args) -> dict:
    res = CliRunner().invoke(main, ["inspect", *map(str, args), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_json_lists_the_worst_tensors_and_counts_the_rest(tmp_path):
    n = JSON_TENSORS + 100
    sd = {f"layer{i}.weight": torch.full((4,), 0.5) for i in range(n)}
    sd["layer7.weight"][0] = float("nan")
    sd[f"layer{n - 1}.weight"][:] = 7e4  # FP16 overflow, last in the file
    path = tmp_path / "ckpt.pt"
    torch.save(sd, path)
    f = _inspect(path)["files"][0]
    names = [t["name"] for t in f["tensors"]]
    assert len(names) == JSON_TENSORS and f["tensors_total"] == n and f["tensors_omitted"] == 100
    assert "layer7.weight" in names and f"layer{n - 1}.weight" in names  # the worst are kept
    assert names == sorted(names, key=lambda s: int(s[5:-7]))  # in the file's order
    every = _inspect(path, "--all-tensors")["files"][0]
    assert len(every["tensors"]) == n and "tensors_total" not in every


def test_a_pairs_diff_lists_are_bounded_too(tmp_path):
    n = JSON_TENSORS + 10
    a = {f"w{i}": torch.full((4,), 1.0) for i in range(n)}
    b = {k: v.clone() for k, v in a.items()}
    b["w3"] += 1.0  # the one that moved
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    diff = _inspect(tmp_path / "a.pt", tmp_path / "b.pt")["diff"]
    assert len(diff["changes"]) == JSON_TENSORS and diff["changes_total"] == n
    assert "w3" in [c["name"] for c in diff["changes"]]
    assert len(diff["stalled"]) == JSON_TENSORS and diff["stalled_total"] == n - 1 and diff["stalled_omitted"] == 9


def test_a_small_file_lists_every_tensor_without_totals(tmp_path):
    torch.save({"w": torch.ones(3), "b": torch.zeros(2)}, tmp_path / "s.pt")
    f = _inspect(tmp_path / "s.pt")["files"][0]
    assert [t["name"] for t in f["tensors"]] == ["w", "b"] and "tensors_total" not in f


def test_a_findings_tensor_list_is_bounded_and_counts_the_rest(tmp_path):
    n = JSON_TENSORS + 10
    torch.save({f"w{i}": torch.full((2,), float("nan")) for i in range(n)}, tmp_path / "nan.pt")
    (f,) = [f for f in _inspect(tmp_path / "nan.pt")["findings"] if f["check"] == "nonfinite_weights"]
    assert len(f["evidence"]["tensors"]) == JSON_TENSORS and f["evidence"]["tensors_total"] == n
    assert f["evidence"]["tensors_omitted"] == 10 and f"{n} weights hold NaN/Inf" in f["message"]

"""``analyzer autopsy`` on the hostile corpus (tests/hostile_corpus.py): every broken run directory,
log and snapshot that ``report`` and ``replay`` refuse, autopsy refuses the same way: one
``Error:`` line, exit 1, no traceback, the input left byte for byte as it was."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from analyzer.cli import main
from recorders import schema
from tests.hostile_corpus import CASES
from tests.test_hostile_inputs import SURVIVABLE, assert_one_error_line, tree_hash

from .autopsy_runs import INF_STEP

# checkpoints and safetensors files are inspect's input, never an autopsy's
_RUNS = [(n, b) for n, b in CASES if n not in SURVIVABLE and not n.startswith(("checkpoint ", "safetensors "))]


def _args(build, where: Path) -> list[str]:
    where.mkdir()
    return build(where)


@pytest.fixture(scope="module")
def good_run(inf_target_run) -> Path:
    return inf_target_run  # shared with test_autopsy_cli.py (tests/analyzer/conftest.py); copied before writing


@pytest.mark.parametrize("name, build", _RUNS, ids=[c[0] for c in _RUNS])
def test_each_hostile_input_is_one_error_line_for_autopsy_too(tmp_path, good_run, name, build):
    args = _args(build, tmp_path / "in")
    if args[0] == "report":
        target = args[1]
    else:
        assert args[0] == "replay", args
        # the hostile file becomes the first failing snapshot of an otherwise good run
        run = Path(shutil.copytree(good_run, tmp_path / "run"))
        shutil.copyfile(args[1], run / schema.SNAPSHOT_DIR / schema.snapshot_name(INF_STEP, 0, "nonfinite_loss"))
        target = str(run)
    root = Path(target) if Path(target).is_dir() else Path(target).parent
    before = tree_hash(root)
    res = CliRunner().invoke(main, ["autopsy", target, "--device", "cpu"])
    assert tree_hash(root) == before
    line = assert_one_error_line(res.exit_code, res.stderr, res.stdout)
    if args[0] == "replay":
        assert line.startswith(f"Error: {root / schema.SNAPSHOT_DIR}")  # names the snapshot
        assert f"amp-autopsy report: {root}" in res.stdout  # and the report is not lost

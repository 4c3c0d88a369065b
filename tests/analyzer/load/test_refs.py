"""The import rule: a snapshot names code; replay imports it only when the rule allows it.

Every security case runs the real ``analyzer replay`` (CliRunner in-process, a few real
subprocesses) on a real snapshot whose ``factory``/``loss_fn`` (or a builder's class argument)
was edited to reach code that writes a marker file, and asserts: exit status 1, one ``Error:``
line, and no marker. The positive cases show that the bundled samples, a user package found
through ``--path`` or the current directory, and ``--show`` still work. A package found only
under the snapshot's recorded cwd (a shared run directory) is not imported; the error names it
and ``--path``.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzer.cli import main
from recorders import Recorder, imports, schema
from recorders.refs import import_class, to_ref
from recorders.snapshot import build_snapshot, write_snapshot
from tests.extras import require

ANALYZER = str(Path(sys.executable).with_name("analyzer"))

# A user package: `build`/`loss` are what a real project's training script would name. Importing
# `models` writes IMPORTED so a test can tell whether anything was imported at all.
USER_MODELS = """
import os
from pathlib import Path
import torch
if os.environ.get("H1_IMPORT_MARKER"):
    Path(os.environ["H1_IMPORT_MARKER"]).touch()


def build(d=4):
    return torch.nn.Linear(d, 1)


def loss(model, batch):
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
"""

# Module-level code that writes the marker: the module must never even be imported.
PWN_ON_IMPORT = "from pathlib import Path\nPath({marker!r}).touch()\n"


class _Pickled:
    """An object whose unpickling writes a marker (what numpy:load/torch:load would run)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.fixture(autouse=True)
def _forget_test_modules():
    """Modules imported from tmp dirs are dropped again, so each test decides afresh."""
    before = set(sys.modules)
    path = list(sys.path)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("userpkg", "evilmod", "evilpkg", "helper", "numpy_shadow"):
            del sys.modules[name]
    assert sys.path == path, "the import rule left sys.path changed"


def _user_project(root: Path) -> Path:
    pkg = root / "userpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(USER_MODELS)
    return root


def _snapshot(path: Path, *, factory="userpkg.models:build", loss_fn="userpkg.models:loss",
              factory_kwargs=None, cwd=None, drop_cwd=False) -> Path:
    """A real snapshot (Linear(4, 1), one batch) with the references set as given."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    batch = {"x": torch.randn(2, 4), "y": torch.randn(2, 1)}
    snap = build_snapshot(step=1, reason="manual", model=model, batch=batch,
                          rng={"cpu": torch.get_rng_state(), "cuda": None}, factory=factory,
                          factory_kwargs=factory_kwargs or {"d": 4}, loss_fn=loss_fn, amp_dtype=torch.bfloat16,
                          device_type="cpu", cwd=cwd or os.devnull)
    if drop_cwd:
        del snap["cwd"]
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_snapshot(path, snap)


def _invoke(*args):
    return CliRunner().invoke(main, ["replay", *map(str, args)])


def _refused(result, marker: Path | None = None) -> str:
    """Exit 1, exactly one line, starting with ``Error:``; the marker never appeared."""
    if marker is not None:
        assert not marker.exists(), "code named by the snapshot ran"
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


def _run_cli(args, cwd: Path, env_extra=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(env_extra or {})
    return subprocess.run([ANALYZER, "replay", *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def _refused_proc(proc: subprocess.CompletedProcess, marker: Path) -> str:
    assert not marker.exists(), "code named by the snapshot ran"
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    return lines[0]


# -- references that reach past the module they name ---------------------------------------------
@pytest.mark.parametrize("ref", [
    "analyzer.load.refs:os.system",            # the bypass: attribute chain through an import
    "samples.models:torch.load",             # the bypass: torch re-exported by an allowed module
    "recorders.refs:importlib.import_module",
    "recorders.schema:_os.system",           # a dotted qualname chain through a private alias
    "samples.models:F.__dict__",
])
def test_attribute_chains_after_the_colon_are_refused_before_anything_runs(tmp_path, monkeypatch, ref):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    path = _snapshot(tmp_path / "s.pt", factory=ref,
                     factory_kwargs={"command": f"touch {marker}", "f": str(marker), "name": "os"})
    line = _refused(_invoke(path), marker)
    assert "is not of the form 'pkg.module:function'" in line and "--factory" in line


@pytest.mark.parametrize("ref", ["os:system", "builtins:eval", "torch:load", "subprocess:run", "shutil:rmtree",
                                 "json:loads", "__main__:main"])
def test_the_standard_library_builtins_and_torch_are_refused(tmp_path, monkeypatch, ref):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    payload = tmp_path / "payload.pt"
    torch.save({"x": _Pickled(str(marker))}, payload, pickle_module=pickle)
    kwargs = {"command": f"touch {marker}", "f": str(payload), "weights_only": False}
    line = _refused(_invoke(_snapshot(tmp_path / "s.pt", factory=ref, factory_kwargs=kwargs)), marker)
    assert f"refusing factory {ref!r}" in line and "standard library" in line and "--factory" in line


def test_numpy_load_with_allow_pickle_is_refused_as_site_packages(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    payload = tmp_path / "payload.npy"
    np.save(payload, np.array([_Pickled(str(marker))], dtype=object), allow_pickle=True)
    path = _snapshot(tmp_path / "s.pt", factory="numpy:load",
                     factory_kwargs={"file": str(payload), "allow_pickle": True})
    line = _refused(_invoke(path), marker)
    assert "refusing factory 'numpy:load'" in line and "site-packages" in line and "--factory" in line


def test_a_recorded_cwd_pointing_into_site_packages_does_not_open_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    payload = tmp_path / "payload.npy"
    np.save(payload, np.array([_Pickled(str(marker))], dtype=object), allow_pickle=True)
    site = str(Path(np.__file__).resolve().parent.parent)
    path = _snapshot(tmp_path / "s.pt", factory="numpy:load", cwd=site,
                     factory_kwargs={"file": str(payload), "allow_pickle": True})
    assert "site-packages" in _refused(_invoke(path), marker)


def test_a_bundled_scenario_runner_which_writes_files_is_not_on_the_allow_list(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"  # samples.healthy:run(out_dir) would train and create it
    path = _snapshot(tmp_path / "s.pt", factory="samples.healthy:run", factory_kwargs={"out_dir": str(marker)})
    assert "outside the --path roots and the current directory" in _refused(_invoke(path), marker)


def test_a_recorded_cwd_of_the_filesystem_root_opens_nothing(tmp_path, monkeypatch):
    # With "/" as a root, /tmp/NAME.py would be the module tmp.NAME (a namespace package).
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    evil = Path("/tmp") / f"h1_import_rule_{os.getpid()}.py"
    evil.write_text(PWN_ON_IMPORT.format(marker=str(marker)) + "def build(**kw):\n    pass\n")
    try:
        path = _snapshot(tmp_path / "s.pt", factory=f"tmp.{evil.stem}:build", cwd="/")
        assert "cannot import factory" in _refused(_invoke(path), marker)
    finally:
        evil.unlink()


def test_an_object_re_exported_from_another_module_is_refused(tmp_path, monkeypatch):
    # userpkg.models does `from os import system` and `from helper import build`: both names
    # exist in the module, neither is defined there.
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    _user_project(tmp_path)
    (tmp_path / "helper.py").write_text(f"def build(**kw):\n    open({str(marker)!r}, 'w').close()\n")
    (tmp_path / "userpkg" / "models.py").write_text("from os import system\nfrom helper import build\n")
    for ref, kwargs in (("userpkg.models:system", {"command": f"touch {marker}"}), ("userpkg.models:build", {})):
        line = _refused(_invoke(_snapshot(tmp_path / "s.pt", factory=ref, factory_kwargs=kwargs)), marker)
        assert "must be a function or class defined in userpkg.models" in line


def test_a_callable_object_that_is_not_a_function_or_class_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    _user_project(tmp_path)
    (tmp_path / "userpkg" / "models.py").write_text(
        "import functools, os\nbuild = functools.partial(os.system)\n")
    line = _refused(_invoke(_snapshot(tmp_path / "s.pt", factory="userpkg.models:build",
                                      factory_kwargs={"command": f"touch {marker}"})), marker)
    assert "found partial" in line


def test_an_evilmod_in_the_cwd_is_never_imported_through_a_class_attribute_chain(tmp_path, monkeypatch):
    # `pkg.mod:Class.method`: refused by form, so evilmod's module-level code never runs either.
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    (tmp_path / "evilmod.py").write_text(PWN_ON_IMPORT.format(marker=str(marker))
                                         + "class Evil:\n    @staticmethod\n    def run(**kw):\n        pass\n")
    for ref in ("evilmod:Evil.run", "evilmod:os.system", "./evilmod.py:build", "evilmod.py:build"):
        _refused(_invoke(_snapshot(tmp_path / "s.pt", factory=ref)), marker)


def test_a_numpy_py_in_the_cwd_that_shadows_installed_numpy_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    (tmp_path / "numpy.py").write_text(PWN_ON_IMPORT.format(marker=str(marker)) + "def load(**kw):\n    pass\n")
    line = _refused(_invoke(_snapshot(tmp_path / "s.pt", factory="numpy:load")), marker)
    assert "refusing factory 'numpy:load'" in line and "shadowed" in line


def test_a_samples_folder_in_the_cwd_never_stands_in_for_the_bundled_samples(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    fake = tmp_path / "samples"
    fake.mkdir()
    (fake / "__init__.py").write_text(PWN_ON_IMPORT.format(marker=str(marker)))
    (fake / "models.py").write_text("def build_mlp(**kw):\n    pass\n")
    plan = imports.plan_ref("samples.models:build_mlp", [str(tmp_path)])
    assert plan.allowed and plan.file == str(Path(schema.__file__).resolve().parents[1] / "samples" / "models.py")
    assert not marker.exists()


# -- builders' class arguments --------------------------------------------------------------------
@pytest.mark.parametrize("model_class, why", [
    ("os:system", "standard library"),
    ("numpy:load", "site-packages"),
    ("transformers:AutoModel", "defined in transformers"),           # re-exported, and not a PreTrainedModel
    ("transformers.models.gpt2.modeling_gpt2:torch", "must be a function or class"),
    ("transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel.from_pretrained", "not of the form"),
    ("userpkg.models:Evil", "not a subclass of transformers"),
])
def test_the_hf_builders_model_class_follows_the_rule(tmp_path, monkeypatch, model_class, why):
    require("transformers", "hf")
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    _user_project(tmp_path)
    (tmp_path / "userpkg" / "models.py").write_text(
        f"class Evil:\n    config_class = dict\n    def __init__(self, *a, **k):\n        open({str(marker)!r}, 'w').close()\n")
    path = _snapshot(tmp_path / "s.pt", factory="recorders.integrations.hf:build_pretrained",
                     loss_fn="recorders.integrations.hf:pretrained_loss",
                     factory_kwargs={"model_class": model_class, "config": {"command": f"touch {marker}"}})
    line = _refused(_invoke(path), marker)
    assert "model_class" in line and why in line


def test_the_lightning_builders_module_class_follows_the_rule(tmp_path, monkeypatch):
    require("lightning", "lightning")
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    path = _snapshot(tmp_path / "s.pt", factory="recorders.integrations.lightning:build_module",
                     loss_fn="recorders.integrations.lightning:training_step_loss",
                     factory_kwargs={"module_class": "os:system", "hparams": {"command": f"touch {marker}"}})
    line = _refused(_invoke(path), marker)
    assert "refusing module_class 'os:system'" in line


def test_the_hf_builder_builds_a_transformers_class_and_refuses_a_non_subclass():
    transformers = require("transformers", "hf")
    from recorders.integrations.hf import build_pretrained

    model = build_pretrained("transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel",
                             {"vocab_size": 8, "n_embd": 8, "n_layer": 1, "n_head": 2, "n_positions": 8})
    assert isinstance(model, transformers.PreTrainedModel)
    with pytest.raises(ValueError, match="not a subclass"):
        import_class("samples.models:MLP", transformers.PreTrainedModel)


# -- real subprocesses: the CLI as a user runs it -------------------------------------------------
def test_a_package_init_outside_the_roots_never_runs_even_on_pythonpath(tmp_path):
    # evilpkg sits on PYTHONPATH, outside --path and the current directory:
    # locating evilpkg.models must not import evilpkg (importlib.util.find_spec would).
    marker = tmp_path / "pwned"
    elsewhere, work = tmp_path / "elsewhere", tmp_path / "work"
    (elsewhere / "evilpkg").mkdir(parents=True)
    work.mkdir()
    (elsewhere / "evilpkg" / "__init__.py").write_text(PWN_ON_IMPORT.format(marker=str(marker)))
    (elsewhere / "evilpkg" / "models.py").write_text("def build(**kw):\n    pass\n")
    path = _snapshot(work / "s.pt", factory="evilpkg.models:build", cwd=str(work))
    line = _refused_proc(_run_cli([path], work, {"PYTHONPATH": str(elsewhere)}), marker)
    # the error names the folder for --path first; evilpkg's __init__ never ran (no marker)
    assert f"the model code is at {elsewhere / 'evilpkg' / 'models.py'}" in line
    assert f"rerun with --path {elsewhere}" in line


def test_os_system_through_an_allowed_module_never_runs_in_a_real_replay(tmp_path):
    # The snapshot comes from the real Recorder; only its factory reference was edited.
    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    with Recorder(run, model, factory="samples.models:build_mlp", factory_kwargs={}, loss_fn="samples.models:mlp_loss") as rec:
        rec.begin_step(0, {"x": torch.randn(2, 4)})
        rec.end_step(torch.tensor(1.0))
        rec.snapshot("manual")
    snap_path = next((run / schema.SNAPSHOT_DIR).glob("*.pt"))
    snap = torch.load(snap_path, weights_only=True)
    snap["factory"], snap["factory_kwargs"] = "analyzer.load.refs:os.system", {"command": f"touch {marker}"}
    edited = tmp_path / "edited.pt"
    torch.save(snap, edited)
    _refused_proc(_run_cli([edited], tmp_path), marker)
    snap["factory"] = "os:system"
    torch.save(snap, edited)
    _refused_proc(_run_cli([edited], tmp_path), marker)


def test_a_numpy_py_shadow_is_refused_in_a_fresh_process(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / "numpy.py").write_text(PWN_ON_IMPORT.format(marker=str(marker)) + "def load(**kw):\n    pass\n")
    path = _snapshot(tmp_path / "s.pt", factory="numpy:load", cwd=str(tmp_path))
    assert "shadowed" in _refused_proc(_run_cli([path], tmp_path), marker)


# -- what still works ---------------------------------------------------------------------------
def test_a_samples_snapshot_replays_from_any_directory(tmp_path, monkeypatch):
    from samples import models
    from samples.bf16_nan import MLP_KWARGS

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = models.build_mlp(**MLP_KWARGS)
    batch = {"x": torch.randn(4, 16), "y": torch.tensor([0, 1, 2, 3])}
    snap = build_snapshot(step=1, reason="manual", model=model, batch=batch,
                          rng={"cpu": torch.get_rng_state(), "cuda": None}, factory="samples.models:build_mlp",
                          factory_kwargs=MLP_KWARGS, loss_fn="samples.models:mlp_loss", amp_dtype=None,
                          device_type="cpu", cwd="/nonexistent")
    result = _invoke(write_snapshot(tmp_path / "s.pt", snap), "--json")
    assert result.exit_code == 0, result.output


def test_a_user_factory_only_under_the_recorded_cwd_is_not_imported_and_the_error_names_path(
        tmp_path, monkeypatch):
    project, elsewhere = _user_project(tmp_path / "proj"), tmp_path / "elsewhere"
    elsewhere.mkdir()
    marker = tmp_path / "imported"
    monkeypatch.setenv("H1_IMPORT_MARKER", str(marker))
    monkeypatch.chdir(elsewhere)
    line = _refused(_invoke(_snapshot(tmp_path / "s.pt", cwd=str(project)), "--json"), marker)
    assert line == (f"Error: will not import factory 'userpkg.models:build' on the snapshot's word: the model code "
                    f"is recorded at {project / 'userpkg' / 'models.py'}; if you trust it, rerun with --path "
                    f"{project} (or run from {project})")
    assert "userpkg" not in sys.modules
    result = _invoke(tmp_path / "s.pt", "--json", "--path", project)
    assert result.exit_code == 0, result.output
    assert marker.exists() and sys.modules["userpkg.models"].__file__ == str(project / "userpkg" / "models.py")


def test_replaying_from_the_directory_trained_in_imports_the_recorded_factory(tmp_path, monkeypatch):
    project = _user_project(tmp_path / "proj")
    monkeypatch.chdir(project)
    result = _invoke(_snapshot(tmp_path / "s.pt", cwd=str(project)), "--json")
    assert result.exit_code == 0, result.output
    assert sys.modules["userpkg.models"].__file__ == str(project / "userpkg" / "models.py")


def test_a_user_factory_is_found_through_path(tmp_path, monkeypatch):
    project, elsewhere = _user_project(tmp_path / "proj"), tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path = _snapshot(tmp_path / "s.pt", drop_cwd=True)
    assert _invoke(path, "--json", "--path", project).exit_code == 0


def test_a_user_factory_is_found_when_replaying_from_its_directory(tmp_path, monkeypatch):
    project = _user_project(tmp_path / "proj")
    monkeypatch.chdir(project)
    assert _invoke(_snapshot(tmp_path / "s.pt", drop_cwd=True), "--json").exit_code == 0


def test_a_missing_factory_names_path_and_pythonpath(tmp_path, monkeypatch):
    _user_project(tmp_path / "proj")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    line = _refused(_invoke(_snapshot(tmp_path / "s.pt", drop_cwd=True)))
    assert "cannot import factory 'userpkg.models:build'" in line and "--path" in line and "PYTHONPATH" in line


def test_an_explicit_factory_may_point_anywhere_but_keeps_the_form_rule(tmp_path, monkeypatch):
    project = _user_project(tmp_path / "proj")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.syspath_prepend(str(project))  # as PYTHONPATH would
    path = _snapshot(tmp_path / "s.pt", factory="gone:build", loss_fn="gone:loss", drop_cwd=True)
    assert _invoke(path, "--json", "--factory", "userpkg.models:build",
                   "--loss-fn", "userpkg.models:loss").exit_code == 0
    line = _refused(_invoke(path, "--factory", "userpkg.models:os.system"))
    assert "not of the form" in line


def test_show_prints_the_files_and_imports_nothing(tmp_path, monkeypatch):
    project = _user_project(tmp_path / "proj")
    marker = tmp_path / "imported"
    monkeypatch.setenv("H1_IMPORT_MARKER", str(marker))
    monkeypatch.chdir(tmp_path)
    result = _invoke(_snapshot(tmp_path / "s.pt", cwd=str(project)), "--show", "--path", project)
    assert result.exit_code == 0, result.output
    assert f"file: {project / 'userpkg' / 'models.py'}" in result.output
    assert "rule: allowed: under " + str(project) in result.output
    assert "nothing was imported" in result.output
    shown = json.loads(_invoke(tmp_path / "s.pt", "--show", "--json", "--path", project).output)
    assert [(r["role"], r["allowed"]) for r in shown["imports"]] == [("factory", True), ("loss_fn", True)]
    assert [r["kind"] for r in shown["roots"]] == ["path", "cwd", "own"]
    assert shown["recorded_cwd"] == {"dir": str(project), "root": True}  # under the --path given
    assert not marker.exists() and "userpkg" not in sys.modules
    # the same snapshot replayed for real does import it: the marker proves the check can fail
    assert _invoke(tmp_path / "s.pt", "--json", "--path", project).exit_code == 0 and marker.exists()


def test_show_says_which_roots_came_from_where_and_that_the_recorded_cwd_is_none(tmp_path, monkeypatch):
    project = _user_project(tmp_path / "proj")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    result = _invoke(_snapshot(tmp_path / "s.pt", cwd=str(project)), "--show")
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"  current directory: {tmp_path / 'elsewhere'}" in out
    assert "  amp-autopsy's own modules: " in out and "samples.models" in out
    assert f"  not a root: the recorded cwd {project} (the snapshot's word" in out
    assert "cannot find module 'userpkg.models' under the --path roots and the current directory" in out
    shown = json.loads(_invoke(tmp_path / "s.pt", "--show", "--json").output)
    assert shown["recorded_cwd"] == {"dir": str(project), "root": False}
    assert [(r["kind"], r["dir"]) for r in shown["roots"][:1]] == [("cwd", str(tmp_path / "elsewhere"))]


def test_show_marks_refused_references_and_a_builders_class_argument(tmp_path, monkeypatch):
    require("transformers", "hf")  # the class argument is located in transformers' own files
    monkeypatch.chdir(tmp_path)
    path = _snapshot(tmp_path / "s.pt", factory="recorders.integrations.hf:build_pretrained", loss_fn="os:system",
                     factory_kwargs={"model_class": "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel",
                                     "config": {}})
    result = _invoke(path, "--show")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "factory: 'recorders.integrations.hf:build_pretrained'" in out and "amp-autopsy's own module" in out
    assert "factory_kwargs.model_class:" in out and "modeling_gpt2.py" in out and "part of transformers" in out
    assert "loss_fn: 'os:system'" in out and "rule: REFUSED" in out


# -- the recorder side: to_ref records only what replay will accept ------------------------------
class _Holder:
    @staticmethod
    def build():
        return torch.nn.Linear(1, 1)


def _top_level_factory():
    return torch.nn.Linear(1, 1)


@pytest.mark.parametrize("fn, match", [
    (_Holder.build, "not a top-level function"),
    (os.system, "not a plain function or class"),
    (torch.load, "standard library, builtins or torch"),
    ("pkg.mod:Class.method", "not of the form"),
    ("os:system", "standard library, builtins or torch"),
])
def test_to_ref_refuses_what_replay_would_refuse(fn, match):
    with pytest.raises(ValueError, match=match):
        to_ref(fn, "factory")


def test_to_ref_accepts_a_top_level_function_and_replay_resolves_it_back():
    ref = to_ref(_top_level_factory, "factory")
    assert ref == f"{__name__}:_top_level_factory"
    assert imports.import_ref(ref) is _top_level_factory


def test_to_ref_warns_at_record_time_when_replay_would_not_import_the_factory(tmp_path, monkeypatch):
    project = _user_project(tmp_path / "proj")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.syspath_prepend(str(project))  # importable in training (PYTHONPATH), not under the cwd
    from userpkg.models import build

    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.warns(UserWarning, match="replay will not import factory 'userpkg.models:build'.*--path DIR"):
        assert to_ref(build, "factory") == "userpkg.models:build"
    monkeypatch.chdir(project)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert to_ref(build, "factory") == "userpkg.models:build"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60) | st.from_regex(r"[a-z_.]{1,12}:[A-Za-z_.]{1,12}", fullmatch=True))
def test_planning_any_reference_read_from_a_file_imports_nothing(ref):
    before = set(sys.modules)
    plan = imports.plan_ref(ref)
    assert set(sys.modules) == before
    if plan.allowed:
        module, name = ref.split(":")
        assert "." not in name and plan.file is not None


# -- a shared run: someone sends a run directory with its model code beside it ---------------------
def _shared_bundle(root: Path) -> tuple[Path, Path]:
    """A run recorded by the real Recorder from `root`, with `root/userpkg` beside it.

    Importing ``userpkg.models`` writes the marker named by H1_IMPORT_MARKER. Its step 1 has a NaN
    loss, so the run holds a ``nonfinite_loss`` snapshot whose ``factory`` and recorded ``cwd``
    name the bundle. Returns (bundle root, run directory).
    """
    _user_project(root)
    run = root / "run"
    here = os.getcwd()
    sys.path.insert(0, str(root))
    try:
        os.chdir(root)  # trained from the bundle: the recorded cwd is `root`
        from userpkg.models import build, loss

        torch.manual_seed(0)
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with Recorder(run, model, factory=build, factory_kwargs={}, loss_fn=loss, optimizer=opt) as rec:
            for step in range(3):
                batch = {"x": torch.randn(2, 4), "y": torch.randn(2, 1)}
                if step == 1:
                    batch["x"][0, 0] = float("nan")
                rec.begin_step(step, batch)
                value = loss(model, batch)
                value.backward()
                rec.end_step(value)
                opt.step()
                opt.zero_grad()
    finally:
        os.chdir(here)
        sys.path.remove(str(root))
        for name in [n for n in sys.modules if n.split(".")[0] == "userpkg"]:
            del sys.modules[name]
    return root, run


@pytest.fixture
def shared_bundle(tmp_path, monkeypatch):
    root, run = _shared_bundle(tmp_path / "bundle")
    marker = tmp_path / "imported"
    monkeypatch.setenv("H1_IMPORT_MARKER", str(marker))
    (tmp_path / "mine").mkdir()
    monkeypatch.chdir(tmp_path / "mine")  # the recipient's own directory
    snap = next((run / schema.SNAPSHOT_DIR).glob("*nonfinite_loss.pt"))
    assert torch.load(snap, weights_only=True)["cwd"] == str(root)  # the snapshot names the bundle
    return root, run, snap, marker


def test_a_shared_run_replayed_from_another_directory_imports_nothing(shared_bundle):
    root, run, snap, marker = shared_bundle
    line = _refused(_invoke(snap), marker)
    assert f"the model code is recorded at {root / 'userpkg' / 'models.py'}" in line
    assert f"rerun with --path {root} (or run from {root})" in line
    assert "userpkg" not in sys.modules


def test_a_shared_run_under_autopsy_from_another_directory_imports_nothing(shared_bundle):
    root, run, snap, marker = shared_bundle
    result = CliRunner().invoke(main, ["autopsy", str(run)])
    assert not marker.exists(), "code beside the shared run ran"
    assert result.exit_code == 1, result.output
    error = [ln for ln in result.output.splitlines() if ln.startswith("Error: ")]
    assert len(error) == 1 and f"rerun with --path {root}" in error[0], result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", ["replay", "autopsy"])
def test_a_shared_run_imports_its_code_once_the_user_names_it_with_path(shared_bundle, command):
    root, run, snap, marker = shared_bundle
    target = snap if command == "replay" else run
    result = CliRunner().invoke(main, [command, str(target), "--json", "--path", str(root)])
    assert marker.exists(), result.output
    assert sys.modules["userpkg.models"].__file__ == str(root / "userpkg" / "models.py")
    assert result.exit_code == 0, result.output


def test_a_shared_run_replays_from_the_directory_it_was_trained_in(shared_bundle, monkeypatch):
    root, run, snap, marker = shared_bundle
    monkeypatch.chdir(root)
    result = _invoke(snap, "--json")
    assert result.exit_code == 0, result.output
    assert marker.exists()

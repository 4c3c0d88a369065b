"""A factory or loss reference that names nothing its module defines is a typo, said as one ("did you
mean"), in one ``Error:`` line; a refusal of code the rule will not import keeps its own wording."""
from __future__ import annotations

import sys

import pytest

from recorders import imports
from tests.analyzer.load.test_refs import _forget_test_modules, _invoke, _refused, _snapshot, _user_project  # noqa: F401


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _user_project(tmp_path)
    return tmp_path


def test_a_misspelt_recorded_factory_gets_did_you_mean(project):
    line = _refused(_invoke(_snapshot(project / "s.pt", factory="userpkg.models:buld")))
    assert line.startswith("Error: no function 'buld' in userpkg.models; did you mean 'build'? (check the name "
                           "after the colon; pass --factory pkg.module:function to name another)"), line
    assert "refusing" not in line


def test_a_misspelt_explicit_loss_fn_gets_did_you_mean_naming_its_option(project):
    path = _snapshot(project / "s.pt")
    line = _refused(_invoke(path, "--loss-fn", "userpkg.models:los"))
    assert "no function 'los' in userpkg.models; did you mean 'loss'?" in line and "--loss-fn" in line


def test_a_name_far_from_every_defined_one_says_so_without_a_guess(project):
    line = _refused(_invoke(_snapshot(project / "s.pt", factory="userpkg.models:zzzzzz")))
    assert "no function 'zzzzzz' in userpkg.models (it defines 2 functions and classes)" in line
    assert "did you mean" not in line


def test_an_imported_name_is_still_refused_as_not_defined_there(project):
    # `torch` is a top-level name of userpkg.models, but a module imported there: the security wording
    line = _refused(_invoke(_snapshot(project / "s.pt", factory="userpkg.models:torch")))
    assert "refusing factory 'userpkg.models:torch': it must be a function or class defined in userpkg.models" \
        in line


def test_the_guess_names_only_functions_and_classes_defined_in_the_module(project):
    (project / "userpkg" / "models.py").write_text(
        "from os import system as buildx\n\ndef make_model():\n    pass\n")
    sys.modules.pop("userpkg.models", None)
    with pytest.raises(imports.ImportRuleError) as e:
        imports.import_ref("userpkg.models:buildx2", (str(project),))
    assert e.value.kind == "undefined" and "did you mean" not in str(e.value)  # buildx is os.system, not defined

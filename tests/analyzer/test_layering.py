"""The analyzer's import graph, read from the source (AST), nothing imported: no cycle (imports under
``if TYPE_CHECKING:`` count too), render/ reaches the analyses through their public packages only,
and the analyzer reaches the recorder through its public modules only."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ANALYSES = ("analyzer.load", "analyzer.replay", "analyzer.report", "analyzer.inspect", "analyzer.autopsy")

def _modules(package: str = "analyzer") -> dict[str, Path]:
    out = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The absolute name of everything `name` imports: at module level, inside a function, or under
    ``if TYPE_CHECKING:`` (``from pkg import x``: ``pkg.x`` where `modules` has it, else ``pkg``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return found - {name}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of `modules` that `name` imports."""
    return {t for t in _targets(name, path, modules) if t in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def _private_recorder_imports(modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(analyzer module, recorder module) for every import of a module of ``recorders`` whose dotted name
    has a part starting with ``_``, whether or not that module exists."""
    recorders = _modules("recorders")
    return sorted((m, t) for m, path in modules.items() for t in _targets(m, path, recorders)
                  if t.split(".")[0] == "recorders" and any(part.startswith("_") for part in t.split(".")[1:]))


def test_the_analyzer_has_no_import_cycle_type_checking_imports_included():
    assert _cycles(_graph()) == []


def test_the_analyzer_imports_no_private_module_of_the_recorder():
    assert _private_recorder_imports(_modules()) == []


def test_render_imports_no_private_module_of_an_analysis():
    graph = _graph()
    bad = sorted((m, t) for m, targets in graph.items() if m.startswith("analyzer.render") for t in targets
                 if t.startswith(ANALYSES) and any(part.startswith("_") for part in t.split(".")[2:]))
    # a public module inside an analysis package is fine only as the package itself or its named modules
    deep = sorted((m, t) for m, targets in graph.items() if m.startswith("analyzer.render") for t in targets
                  if t.startswith(("analyzer.report.checks", "analyzer.replay.detection._origin")))
    assert bad == [] and deep == []


def test_the_import_graph_reader_sees_the_imports_it_must():
    # the reader itself: known edges of the tree are found (relative, parent-relative, lazy)
    graph = _graph()
    assert "analyzer.replay.verdicts.registry" in graph["analyzer.replay.replay"]  # from . import verdicts
    assert "analyzer.load" in graph["analyzer.replay.replay"]             # from ..load import ...
    assert "analyzer.replay" in graph["analyzer.autopsy.autopsy"]        # lazy, inside a function


def test_the_checks_fail_on_a_cycle_through_type_checking_and_on_a_private_recorder_import(tmp_path):
    # the two checks on a tree written here: they must see what they are meant to refuse
    pkg = tmp_path / "analyzer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n")
    (pkg / "c.py").write_text("def f():\n    from recorders._compile import unwrap\n")
    modules = {f"analyzer.{p.stem}" if p.stem != "__init__" else "analyzer": p for p in pkg.glob("*.py")}
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == [["analyzer.a", "analyzer.b", "analyzer.a"]]
    assert _private_recorder_imports(modules) == [("analyzer.c", "recorders._compile")]

"""The analyzer's import graph, read from the source (AST), nothing imported: no cycle, and render/
reaches the analyses through their public packages only."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "analyzer"
ANALYSES = ("analyzer.load", "analyzer.replay", "analyzer.report", "analyzer.inspect", "analyzer.autopsy")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node, except those under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every analyzer module `name` imports when it runs, at module level or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import sub` imports the module pkg.sub when there is one, else names of pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_analyzer_has_no_import_cycle():
    graph = _graph()
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
    assert cycles == []


def test_render_imports_no_private_module_of_an_analysis():
    graph = _graph()
    bad = sorted((m, t) for m, targets in graph.items() if m.startswith("analyzer.render") for t in targets
                 if t.startswith(ANALYSES) and any(part.startswith("_") for part in t.split(".")[2:]))
    # a public module inside an analysis package is fine only as the package itself or its named modules
    deep = sorted((m, t) for m, targets in graph.items() if m.startswith("analyzer.render") for t in targets
                  if t.startswith(("analyzer.report.checks", "analyzer.replay._origin")))
    assert bad == [] and deep == []


def test_the_import_graph_reader_sees_the_imports_it_must():
    # the reader itself: known edges of the tree are found (relative, parent-relative, lazy)
    graph = _graph()
    assert "analyzer.replay.verdicts" in graph["analyzer.replay.replay"]  # from . import verdicts
    assert "analyzer.load" in graph["analyzer.replay.replay"]             # from ..load import ...
    assert "analyzer.replay" in graph["analyzer.autopsy.autopsy"]        # lazy, inside a function

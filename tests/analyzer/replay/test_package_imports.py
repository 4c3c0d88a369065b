"""The replay and autopsy packages import without cycles, ``TYPE_CHECKING`` imports included.

A value type kept beside the code that produces it (``RunTrace`` in the runner, ``AutopsyResult``
beside ``run_autopsy``) makes its readers import the producer, and the producer imports them back.
Values live in value modules (``replay/trace.py``, ``autopsy/result.py``), so the graph of
imports, read from the source with ``ast`` (every ``import``, at any depth), has no cycle.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import analyzer

ROOT = Path(analyzer.__file__).parent


def _modules(pkg: str) -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in (ROOT / pkg).rglob("*.py")}


def _imports(mod: str, path: Path, known: set[str]) -> set[str]:
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out: set[str] = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in n.names if f"{base}.{a.name}" in known]
            out |= set(subs) if len(subs) == len(n.names) else {base, *subs}  # `from . import x`: x only
        elif isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
    return {m for m in out if m in known and m != mod}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        stack.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


@pytest.mark.parametrize("pkg", ["replay", "autopsy"])
def test_the_package_has_no_import_cycle_counting_type_checking_imports(pkg):
    mods = _modules(pkg)
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))

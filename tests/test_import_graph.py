"""runpool's modules import each other without circles: the graph is read from the source with
`ast`, every import counted — module level, inside functions (lazy), under TYPE_CHECKING — so
a circle cannot hide behind a lazy import. Walks the whole package, subpackages included."""

from __future__ import annotations

import ast
from pathlib import Path

import runpool

PACKAGE = Path(runpool.__file__).parent


def modules(package: Path) -> dict[str, Path]:
    """Every module of the package under `package`, by dotted name (a package by its own)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module → the modules of the same package it imports. `from P import x` counts as an
    import of the submodule P.x when there is one, else of P itself."""
    mods = modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[:len(here.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    if f"{target}.{alias.name}" in mods:
                        edges.add(f"{target}.{alias.name}")
                    elif target in mods:
                        edges.add(target)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_runpool_has_no_import_cycles() -> None:
    graph = import_graph(PACKAGE)
    assert "runpool.worker" in graph and "runpool.pool" in graph, sorted(graph)
    assert cycles(graph) == [], "import circles among runpool's modules: " + "; ".join(
        " <-> ".join(c) for c in cycles(graph))


def test_import_graph__sees_lazy_relative_and_type_checking_imports(tmp_path: Path) -> None:
    # A circle closed only by a function-level import, one only under TYPE_CHECKING, one
    # through a subpackage's relative import of its parent: each must be found.
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from .b import B\n",
        "b.py": "def f():\n    from . import a\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import D\n",
        "d.py": "import pkg.c\n",
        "e.py": "from .sub.f import F\n",
        "sub/__init__.py": "",
        "sub/f.py": "from .. import e\n",
        "g.py": "from . import a\n",  # into a circle, but not part of one
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert cycles(import_graph(pkg)) == [
        ["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"], ["pkg.e", "pkg.sub.f"]]

"""The shape of runpool's modules, read from the source with `ast` over the whole package
(subpackages included): they import each other without circles — every import counted,
module level, inside functions (lazy), under TYPE_CHECKING, so a circle cannot hide behind a
lazy import — and none reaches into another module's objects' private members."""

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


# Private names of other modules that runpool may use: os._exit ends a process without its
# exit handlers (a forked worker, an orphan), which is what it is documented for.
PRIVATE_ALLOWED = {"os._exit"}


def private_reaches(source: str) -> list[str]:
    """`x._name` where x is not self/cls and nothing in this source defines `_name`: a reach
    into another module's private state (as `line: expression`)."""
    tree = ast.parse(source)
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            own.add(node.value)  # __slots__ entries
    return sorted(
        f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_")
        and not node.attr.startswith("__") and node.attr not in own
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        and ast.unparse(node) not in PRIVATE_ALLOWED
    )


def test_no_module_reaches_into_another_modules_private_members() -> None:
    reaches = [f"{name}:{reach}" for name, path in modules(PACKAGE).items()
               for reach in private_reaches(path.read_text())]
    assert reaches == []


def test_private_reaches__found() -> None:
    source = (
        "class Own:\n"
        "    def __init__(self, other):\n"
        "        self._mine = 1\n"
        "        other._mine = 2\n"          # a private this module defines: its business
        "        other.run._mark_lost()\n"  # another module's: a reach
        "        self._worker._pool\n"       # a reach too, through an attribute of self
        "        os._exit(1)\n"              # allowed
    )
    assert private_reaches(source) == ["5: other.run._mark_lost", "6: self._worker._pool"]

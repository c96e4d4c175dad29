"""No import cycles between the modules of protos, gateway and worker.

An edge is any `import` or `from ... import` of one of those packages, relative ones resolved,
anywhere in a module: an import inside a function is a cycle all the same, only later. Imports
under `if TYPE_CHECKING:` are left out: they never run. (import-linter's contracts in
pyproject.toml state the layers; this test catches a cycle between any two modules.)
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

PACKAGES = ("protos", "gateway", "worker")
ROOT = Path(__file__).resolve().parent.parent


def module_names(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of the packages under `root`, by dotted name (a package by its __init__)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _ImportCollector(ast.NodeVisitor):
    """Dotted names a module imports (relative imports resolved), `if TYPE_CHECKING:` bodies left out."""

    def __init__(self, package: str) -> None:
        self.package = package  # what a relative import of level 1 is relative to
        self.names: list[str] = []

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.names.extend(alias.name for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            anchor = ".".join(parts[:len(parts) - node.level + 1])
            base = f"{anchor}.{base}" if base else anchor
        # `from a import b` imports the module a.b when there is one, else a name of a
        self.names.extend(f"{base}.{alias.name}" for alias in node.names)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The most specific known module that `name` (a module or a module's attribute) is in."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    """Module -> the modules of the packages it imports (itself excluded)."""
    modules = module_names(root, packages)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        collector = _ImportCollector(package)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        targets = (_resolve(n, modules) for n in collector.names)
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (a depth-first search; sorted, so repeatable)."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path = [start], {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                continue
            if nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_packages_have_no_import_cycle() -> None:
    graph = import_graph(ROOT, PACKAGES)
    assert len(graph) > 50  # the walk found the packages
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_lazy_relative_import_closes_a_cycle(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.sub.b import f\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "def f():\n    from ..c import g\n    return g\n",
        "pkg/c.py": "import pkg.a\n",
    })
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.sub.b"] == {"pkg.c"}  # relative, two levels, inside a function
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]


def test_type_checking_imports_and_outside_packages_are_no_edges(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pkg/__init__.py": "from . import a\n",
        "pkg/a.py": "import os\nimport typing\nfrom pkg import b\n",
        "pkg/b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n"
                     "if typing.TYPE_CHECKING:\n    import pkg.a\nelse:\n    import pkg.c\n"),
        "pkg/c.py": "",
    })
    graph = import_graph(tmp_path, ["pkg"])
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": set()}
    assert find_cycle(graph) is None

"""The import graph of a package read from its sources (``ast``, nothing is imported), and its circles.

An edge ``a -> b`` says that executing module ``a`` executes module ``b`` first: ``import b``,
``from b import name`` and ``from package import b`` (``b`` a module), plus the packages above ``b``
whose ``__init__`` runs on the way (those above ``a`` itself are already running). Only imports
that run when ``a`` is imported count: those at module level, in class bodies, in ``if``/``try``
blocks (not ``if TYPE_CHECKING:``). Imports inside functions run later (*deferred*): the circles that only
deferred imports close are reported apart, as circles those imports break.

Run from the repository root: ``python tests/import_graph.py`` reports on ``e3attn/``.
"""
from __future__ import annotations

import ast
import pathlib
import sys
from typing import Dict, Iterator, List, NamedTuple, Set

ROOT = pathlib.Path(__file__).resolve().parents[1]


class Import(NamedTuple):
    importer: str  # dotted module name
    target: str  # dotted module name inside the package
    line: int
    deferred: bool  # inside a function: runs when called, not when the importer is imported


def module_files(package_dir: pathlib.Path) -> Dict[str, pathlib.Path]:
    """Dotted module name -> source file, for every ``.py`` file of the package in ``package_dir``."""
    files = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _ancestors(name: str) -> List[str]:
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: pathlib.Path, known: Set[str]) -> Iterator[Import]:
    """The imports of module ``name`` (file ``path``) that reach modules in ``known``."""
    is_package = path.name == "__init__.py"
    running = set(_ancestors(name)) | {name}  # packages already executing when ``name`` runs

    def targets(modules: List[str]) -> Iterator[str]:
        for module in modules:
            yield module
            yield from (parent for parent in _ancestors(module) if parent not in running)

    def resolve(node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node: ast.AST, deferred: bool) -> Iterator[Import]:
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = resolve(node)
            modules = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            modules = []
        for target in dict.fromkeys(targets(modules)):
            if target in known and target != name:
                yield Import(name, target, node.lineno, deferred)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children = node.orelse  # the body only runs under a type checker
        else:
            children = list(ast.iter_child_nodes(node))
        inner = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in children:
            yield from visit(child, inner)

    yield from visit(ast.parse(path.read_text(), str(path)), False)


def package_imports(package_dir: pathlib.Path) -> List[Import]:
    """Every import between the modules of the package in ``package_dir``."""
    files = module_files(package_dir)
    return [found for name, path in files.items() for found in imports_of(name, path, set(files))]


def _reachable(edges: Dict[str, Set[str]], start: str) -> Dict[str, str]:
    """Modules reachable from ``start``, each mapped to the module it was reached from (breadth first)."""
    came_from, frontier = {start: ""}, [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(edges.get(module, ())):
                if target not in came_from:
                    came_from[target] = module
                    following.append(target)
        frontier = following
    return came_from


def _path(came_from: Dict[str, str], end: str) -> List[str]:
    path = [end]
    while came_from[path[-1]]:
        path.append(came_from[path[-1]])
    return path[::-1]


def _edges(found: List[Import], deferred: bool) -> Dict[str, Set[str]]:
    edges: Dict[str, Set[str]] = {}
    for item in found:
        if deferred or not item.deferred:
            edges.setdefault(item.importer, set()).add(item.target)
    return edges


def cycles(found: List[Import], deferred: bool = False) -> List[List[str]]:
    """One shortest circle ``[a, b, ..., a]`` through every module that lies on a circle of imports (module-level
    ones only, or also the ``deferred`` ones), each circle once, starting from its smallest name."""
    edges = _edges(found, deferred)
    circles = {}
    for module in sorted(edges):
        came_from = _reachable(edges, module)
        closing = [source for source in sorted(edges) if module in edges[source] and source in came_from]
        if closing:
            circle = min((_path(came_from, source) for source in closing), key=len)
            start = circle.index(min(circle))
            canonical = tuple(circle[start:] + circle[:start])
            circles[canonical] = [*canonical, canonical[0]]
    return sorted(circles.values())


def broken_circles(found: List[Import]) -> List[str]:
    """The circles that only deferred imports close, written ``a -> b ~> c -> a`` (``~>``: deferred)."""
    eager = _edges(found, deferred=False)
    lines = []
    for circle in cycles(found, deferred=True):
        steps = [circle[0]]
        for a, b in zip(circle, circle[1:]):
            steps.append(("-> " if b in eager.get(a, ()) else "~> ") + b)
        if "~>" in "".join(steps):
            lines.append(" ".join(steps))
    return lines


def main(argv: List[str]) -> int:
    if argv:
        print("usage: python tests/import_graph.py (no arguments: reports on e3attn/)", file=sys.stderr)
        return 2
    found = package_imports(ROOT / "e3attn")
    circles = cycles(found)
    print(f"{len(found)} imports between {len(module_files(ROOT / 'e3attn'))} modules of e3attn, "
          f"{sum(item.deferred for item in found)} of them deferred; {len(circles)} circles of module-level imports")
    for circle in circles:
        print("circle: " + " -> ".join(circle))
    for line in broken_circles(found):
        print("circle broken by deferred imports (~>): " + line)
    return 1 if circles else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The import graph of src/prefixserve has no cycle (issue 19: base.py imported every backend).

Edges are read with `ast`, not by importing: every `import` / `from ... import` of a
prefixserve module, except under `if TYPE_CHECKING:` (never run). Module-level imports must
form no cycle: a cycle there makes the import order matter. Imports deferred into a function
(lazy imports of optional parts: Triton, Ray, the server) must form none either: a deferred
import back is the same coupling, only hidden until the function runs (base.py's deferred
import of the backends was the 14-module circle).
`from pkg import name` is an edge to `pkg.name` when that is a module, else to `pkg`. Importing
a submodule runs its package's __init__ first, but that is not an edge: a package that
re-exports its submodules would otherwise be a cycle with each of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import prefixserve

SRC = Path(prefixserve.__file__).parent


def _modules(root: Path) -> dict[str, Path]:
    mods = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(name: str, path: Path, mods: dict[str, Path], deferred: bool) -> set[str]:
    """The prefixserve modules that module `name` (at `path`) imports (with `deferred`: in
    function bodies too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    nodes = [ast.parse(path.read_text(), str(path))]
    while nodes:
        node = nodes.pop()
        if _is_type_checking(node):
            nodes += node.orelse  # type: ignore[attr-defined]
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
        if deferred or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nodes += ast.iter_child_nodes(node)
    return {m for m in out if m in mods and m != name}


def import_graph(root: Path = SRC, deferred: bool = False) -> dict[str, set[str]]:
    mods = _modules(root)
    return {name: _imports(name, path, mods, deferred) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search, sorted for stable names)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_no_import_cycle():
    graph = import_graph()
    assert "prefixserve.attention.base" in graph and graph["prefixserve.engine.workers"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_deferred_import_cycle():
    graph = import_graph(deferred=True)
    assert graph["prefixserve.attention.base"] == set(), \
        "base.py imports nothing of prefixserve: " + str(graph["prefixserve.attention.base"])
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle (deferred imports included): " + " -> ".join(cycle)


@pytest.mark.parametrize("source, cycle", [
    ({"a": "from .b import x\n", "b": "from . import a\n"}, ["p.a", "p.b", "p.a"]),
    ({"a": "from .b import x\n", "b": "def f():\n    from . import a\n"}, ["p.a", "p.b", "p.a"]),
    ({"a": "import p.b\n", "b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"},
     None),
])
def test_finds_a_cycle(tmp_path, source, cycle):
    """The check itself: an import back is a cycle, deferred or not; a TYPE_CHECKING-only one is not."""
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("")
    for mod, text in source.items():
        (tmp_path / "p" / f"{mod}.py").write_text(text)
    assert find_cycle(import_graph(tmp_path / "p", deferred=True)) == cycle
    deferred_only = "def f" in source["b"]
    assert find_cycle(import_graph(tmp_path / "p")) == (None if deferred_only else cycle)

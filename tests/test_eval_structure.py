"""The eval package's import graph: no module imports another that (directly or through others)
imports it back, counting imports inside functions too (a lazy import only hides a cycle)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

PACKAGE = "locks_hf.eval"
# the package as installed (the source tree's eval/ in a development install, the wheel's copy elsewhere)
EVAL = Path(importlib.util.find_spec(PACKAGE).submodule_search_locations[0])


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The eval modules ``path`` imports anywhere in its body (relative or absolute)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # from .x import y / from . import x
                base = node.module or ""
                names = [base] if base else [a.name for a in node.names]
            elif node.module and (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
                base = node.module[len(PACKAGE) + 1 :]
                names = [base] if base else [a.name for a in node.names]
            else:
                continue
            out.update(n.split(".")[0] for n in names)
        elif isinstance(node, ast.Import):
            out.update(a.name[len(PACKAGE) + 1 :].split(".")[0] for a in node.names if a.name.startswith(PACKAGE + "."))
    return out & modules - {path.stem}


def import_graph() -> dict[str, set[str]]:
    files = sorted(EVAL.glob("*.py"))
    modules = {f.stem for f in files}
    return {f.stem: _imports(f, modules) for f in files}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_graph_sees_the_package():
    graph = import_graph()
    assert {"runner", "batched", "plan", "stopping", "merge", "rundir", "cli"} <= set(graph)
    assert {"plan", "stopping"} <= graph["batched"]  # function-level imports count as well:
    assert "merge" in graph["cli"]  # cli imports it inside its subcommands


def test_eval_imports_have_no_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, f"import cycles in eval/ (move what both sides need to a module both import): {cycles}"


def test_cycle_finder_finds_cycles():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []

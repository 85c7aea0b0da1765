"""The module import graph of ``mxdb/`` and ``kernels/`` (installed as ``mxdb.kernels``).

Every ``import`` and ``from ... import`` counts: module level, inside functions, and under
``if TYPE_CHECKING:``.  The graph is at module granularity (``from mxdb.evidence import stats``
is an edge to ``mxdb.evidence.stats``; ``from mxdb.shapes import MoEShape`` to ``mxdb.shapes``).
Importing a submodule also runs its packages' ``__init__``; that is not counted as an edge,
since every module of a package would otherwise be in a circle with its ``__init__``.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package it is installed as
PACKAGES = {"mxdb": "mxdb", "kernels": "mxdb.kernels"}
#: what the GPU layer must not import: it is the bottom layer under the tuner and the runtime
KERNELS_FORBIDDEN = (
    "mxdb.tune",
    "mxdb.dispatcher",
    "mxdb.integrations",
    "mxdb.evidence",
    "mxdb.runtime",
)


def _modules() -> dict[str, tuple[Path, bool]]:
    """``{module name: (file, is a package __init__)}`` for every module of mxdb/ and kernels/."""
    out: dict[str, tuple[Path, bool]] = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder)
            if "migrations" in rel.parts:  # Alembic scripts, loaded by file path
                continue
            parts = list(rel.with_suffix("").parts)
            is_init = parts[-1] == "__init__"
            if is_init:
                parts = parts[:-1]
            out[".".join([package, *parts])] = (path, is_init)
    return out


MODULES = _modules()


def _known(name: str) -> str | None:
    """The module of ours that importing ``name`` names (its longest known prefix), or None."""
    if name == "kernels" or name.startswith("kernels."):
        name = "mxdb." + name
    while name not in MODULES:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def _imports(module: str) -> Iterator[tuple[str, int]]:
    """``(imported module, line)`` for every import of ours anywhere in ``module``."""
    path, is_init = MODULES[module]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name)
                if target:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                if not is_init:
                    parts = parts[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:
                target = _known(f"{base}.{alias.name}")
                if target:
                    yield target, node.lineno


def _graph() -> dict[str, dict[str, int]]:
    """``{module: {imported module: first line}}``, self-imports left out."""
    graph: dict[str, dict[str, int]] = {}
    for module in MODULES:
        edges: dict[str, int] = {}
        for target, line in _imports(module):
            if target != module:
                edges[target] = min(line, edges.get(target, line))
        graph[module] = edges
    return graph


def _cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None when the graph has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    steps = [f"  {a} (line {graph[a][b]}) -> {b}" for a, b in itertools.pairwise(cycle)]
    return "import circle:\n" + "\n".join(steps)


def test_the_scan_sees_every_kind_of_import() -> None:
    graph = _graph()
    # module level, relative to the package, inside a function, under TYPE_CHECKING
    assert "mxdb.shapes" in graph["mxdb"]
    assert "mxdb.kernels.live" in graph["mxdb.hostinfo"]  # inside host_fingerprint
    assert "mxdb.kernels.layer" in graph["mxdb.runtime.hook"]  # inside a method
    assert "mxdb.store" in graph["mxdb.dispatcher"]  # under TYPE_CHECKING
    assert "mxdb.kernels.pipeline" in graph["mxdb.kernels.backend"]  # kernels/ as mxdb.kernels
    assert _cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": 1}, "b": {}}) is None


def test_no_import_circles() -> None:
    graph = _graph()
    cycle = _cycle(graph)
    assert cycle is None, _describe(cycle, graph)


def test_kernels_is_a_leaf_layer() -> None:
    graph = _graph()
    wrong = [
        f"{module} (line {line}) imports {target}"
        for module, edges in sorted(graph.items())
        if module.startswith("mxdb.kernels")
        for target, line in sorted(edges.items())
        if target.startswith(KERNELS_FORBIDDEN)
    ]
    assert not wrong, "the GPU layer imports the layers above it:\n" + "\n".join(wrong)

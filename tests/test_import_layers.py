"""kvsplice's imports run one way, from higher layers to lower ones, and never in a circle.

Every module under kvsplice/ is read with `ast` (nothing is imported), and every import in it
counts: at the top, inside functions, under `if TYPE_CHECKING:`. The layers below are the order
docs/ARCHITECTURE.md states; a module may import its own layer or any layer below it. Importing a
package's submodule also runs the package's `__init__`, but that is not counted as an edge: a
submodule importing a sibling while its package initialises is how packages work, not a circle.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvsplice"

# bottom to top; a module belongs to the first layer one of whose names is the module or a
# package above it ("kvsplice" alone is the package's own __init__: the public API)
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("utils", ("kvsplice.utils", "kvsplice.layer_configs")),
    ("tokenizer", ("kvsplice.tokenizer", "kvsplice.tokenizer_llama2c", "kvsplice.message_offsets")),
    ("structured", ("kvsplice.structured", "kvsplice.sampling_params")),
    ("cache", ("kvsplice.cache",)),
    ("layers", ("kvsplice.layers",)),
    ("models", ("kvsplice.models",)),
    ("reuse", ("kvsplice.reuse",)),
    ("config", ("kvsplice.config",)),
    ("engine", ("kvsplice.engine",)),
    ("api", ("kvsplice",)),
    ("server", ("kvsplice.server",)),
    ("bench", ("kvsplice.bench",)),
    ("cli", ("kvsplice.cli",)),
)


@dataclass(frozen=True)
class Edge:
    """`source` imports `target` (both kvsplice module names) at `path`:`line`."""

    source: str
    target: str
    path: str
    line: int

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_files() -> dict[str, Path]:
    """Every kvsplice module name -> its file (a package is its __init__.py)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def layer_of(module: str) -> int:
    """Index into LAYERS of `module`'s layer; ValueError for a module no layer names."""
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            if module == name or (name != "kvsplice" and module.startswith(name + ".")):
                return index
    raise ValueError(f"{module} is in no layer: add it to LAYERS in tests/test_import_layers.py "
                     "and to the layer order in docs/ARCHITECTURE.md")


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names `node` may import: `import a.b` -> a.b; `from a import b` -> a.b, a."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def _bound_names(path: Path) -> set[str] | None:
    """The names a module binds at its top level (under `if` and `try` too); None when it has a
    module `__getattr__` (any name may come from it)."""
    names = set()
    statements = list(ast.parse(path.read_text(), str(path)).body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.If, ast.Try)):
            statements.extend(node.body + node.orelse + getattr(node, "finalbody", [])
                              + [s for handler in getattr(node, "handlers", []) for s in handler.body])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return None if "__getattr__" in names else names


def import_edges(modules: dict[str, Path]) -> tuple[list[Edge], list[str]]:
    """Every import of one kvsplice module by another, and the imports of kvsplice modules or of
    names in a kvsplice package that do not exist (stale paths)."""
    edges, missing = [], []
    root = PACKAGE.parent
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = _imported_names(node, module, is_package)
            if not any(n == "kvsplice" or n.startswith("kvsplice.") for n in names):
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            if isinstance(node, ast.Import):
                targets = names
            else:
                # `from a import b`: the submodule a.b if there is one, else a name in a
                submodules = [n for n in names[:-1] if n in modules]
                targets = submodules if len(submodules) == len(names) - 1 else submodules + [names[-1]]
                bound = _bound_names(modules[names[-1]]) if names[-1] in modules else None
                missing.extend(f"{where} imports {n}, which {names[-1]} does not define"
                               for n in names[:-1] if n not in modules and bound is not None
                               and n.rsplit(".", 1)[1] not in bound and not n.endswith(".*"))
            for target in targets:
                if target not in modules:
                    missing.append(f"{where} imports {target}, which is no kvsplice module")
                elif target != module:
                    edges.append(Edge(module, target, str(path.relative_to(root)), node.lineno))
    return edges, missing


def cycles(edges: list[Edge]) -> list[tuple[list[str], list[Edge]]]:
    """Each strongly connected group of modules (Tarjan), sorted, with one circle of imports (as
    its edges) inside it."""
    graph: dict[str, list[Edge]] = {}
    for edge in edges:
        graph.setdefault(edge.source, []).append(edge)
        graph.setdefault(edge.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in graph[node]:
            if edge.target not in index:
                visit(edge.target)
                low[node] = min(low[node], low[edge.target])
            elif edge.target in on_stack:
                low[node] = min(low[node], index[edge.target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [(sorted(group), _circle_in(group, graph)) for group in groups]


def _circle_in(group: set[str], graph: dict[str, list[Edge]]) -> list[Edge]:
    """A path of edges inside `group` from its first module (sorted) back to it (breadth first:
    the shortest such circle)."""
    start = min(group)
    paths: dict[str, list[Edge]] = {start: []}
    frontier = [start]
    while frontier:
        next_frontier = []
        for node in frontier:
            for edge in graph[node]:
                if edge.target == start:
                    return paths[node] + [edge]
                if edge.target in group and edge.target not in paths:
                    paths[edge.target] = paths[node] + [edge]
                    next_frontier.append(edge.target)
        frontier = next_frontier
    raise AssertionError(f"no circle through {start} in its group")


def test_every_module_has_a_layer_and_every_import_a_module():
    modules = module_files()
    assert "kvsplice.engine.engine" in modules and "kvsplice" in modules
    unplaced = []
    for module in modules:
        try:
            layer_of(module)
        except ValueError as exc:
            unplaced.append(str(exc))
    assert not unplaced, "\n".join(unplaced)
    _, missing = import_edges(modules)
    assert not missing, "\n".join(missing)


def test_no_module_imports_a_higher_layer():
    edges, _ = import_edges(module_files())
    assert len(edges) > 100
    upward = [f"{edge.where()} {edge.source} ({LAYERS[layer_of(edge.source)][0]}) imports {edge.target} "
              f"({LAYERS[layer_of(edge.target)][0]}), a higher layer"
              for edge in edges if layer_of(edge.target) > layer_of(edge.source)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    edges, _ = import_edges(module_files())
    found = cycles(edges)
    described = [" -> ".join([circle[0].source] + [f"{e.target} ({e.where()})" for e in circle])
                 + (f"; these reach each other by imports: {', '.join(group)}" if len(group) > len(circle) else "")
                 for group, circle in found]
    assert not described, "import cycles:\n" + "\n".join(described)


def test_the_cycle_finder_finds_a_circle_and_only_one():
    edges = [Edge("a", "b", "a.py", 1), Edge("b", "c", "b.py", 1), Edge("c", "a", "c.py", 1),
             Edge("c", "d", "c.py", 2), Edge("d", "e", "d.py", 1)]
    ((group, circle),) = cycles(edges)
    assert group == ["a", "b", "c"]
    assert [e.source for e in circle] == ["a", "b", "c"] and circle[-1].target == "a"
    assert cycles(edges[:2] + edges[3:]) == []


def test_layer_order_matches_architecture_md():
    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    line = next(line for line in text.splitlines() if line.startswith("Layers, bottom to top:"))
    assert line.removeprefix("Layers, bottom to top:").strip().rstrip(".").split(" < ") == \
        [name for name, _ in LAYERS]

"""The packages' modules import each other without cycles, counting every import: inside functions (a lazy
import that breaks a cycle at run time leaves it in the design) and under `if TYPE_CHECKING:`. A cycle is two
modules that cannot be read, changed or moved apart."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "dpserve_shared": ROOT / "shared" / "dpserve_shared",
    "dpserve_engine": ROOT / "services" / "engine" / "dpserve_engine",
    "dpserve_coordinator": ROOT / "services" / "coordinator" / "dpserve_coordinator",
    "dpserve_frontend": ROOT / "services" / "frontend" / "dpserve_frontend",
    "dpserve": ROOT / "dpserve",
}


def _imports(tree: ast.AST, module: str, modules: set[str]) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                parts = module.split(".")[: -node.level]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            names = []
        for name in names:
            while name and name not in modules:  # `from pkg import module` or `from module import name`
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {}
    for package, path in PACKAGES.items():
        for file in path.rglob("*.py"):
            rel = file.relative_to(path).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            files[".".join([package, *parts])] = file
    modules = set(files)
    return {m: _imports(ast.parse(f.read_text()), m, modules) - {m.rpartition(".")[0]} for m, f in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50  # every package was found
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


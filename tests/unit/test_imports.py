"""The data path runs one way: no module of hvdtrain imports, directly or through others, itself."""

import ast
from pathlib import Path

import hvdtrain

PACKAGE = Path(hvdtrain.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str]) -> set[str]:
    """The hvdtrain modules ``path`` imports anywhere in its body (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != "hvdtrain":
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    # A package's modules may import the package's __init__ (it runs first anyway): not an edge.
    return {m: {t for t in imported(p, modules) if t != m and not m.startswith(t + ".")}
            for m, p in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` as a list of modules (first == last), or [] if none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if not state.get(target) and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if not state.get(node) and (cycle := visit(node)):
            return cycle
    return []


def test_find_cycle_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_hvdtrain():
    graph = import_graph()
    assert "hvdtrain.driver" in graph and "hvdtrain.loop" in graph["hvdtrain.session"]
    assert find_cycle(graph) == [], " -> ".join(find_cycle(graph))

"""The data path runs one way: no module of hvdtrain imports, directly or through others, itself.

``python tests/unit/test_imports.py [PACKAGE_DIR]`` prints the import graph of a package directory
(default: this checkout's hvdtrain/), one module and what it imports per line, then its cycles.
"""

import ast
import sys
from pathlib import Path

import hvdtrain

PACKAGE = Path(hvdtrain.__file__).parent


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def absolute(node: ast.ImportFrom, module: str, path: Path) -> str:
    """The absolute name ``from <node.module> import ...`` names in ``module`` (at ``path``):
    ``from . import x`` in ``a/b.py`` is ``a``, ``from ..c import x`` in ``a/b/d.py`` is ``a.c``."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imported(path: Path, modules: set[str], module: str) -> set[str]:
    """The package's modules that ``module`` (at ``path``) imports anywhere in its body (lazy
    and relative imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node, module, path)
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of ``package`` (a directory) and the package's modules it imports."""
    paths = {module_name(p, package): p for p in package.rglob("*.py")}
    modules = set(paths)
    # A package's modules may import the package's __init__ (it runs first anyway): not an edge.
    return {m: {t for t in imported(p, modules, m) if t != m and not m.startswith(t + ".")}
            for m, p in paths.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles a depth-first walk of ``graph`` meets, each a list of modules
    (first == last); empty when there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target):], target])
            elif not state.get(target):
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            visit(node)
    return cycles


def test_find_cycle_finds_a_planted_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_a_cycle_through_relative_imports_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name, text in {"__init__.py": "", "a.py": "from . import b\n",
                       "b.py": "from .sub.c import f\n", "sub/__init__.py": "",
                       "sub/c.py": "def f():\n    from ..a import g\n"}.items():
        (package / name).write_text(text)
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.sub.c"}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


def test_no_import_cycle_in_hvdtrain():
    graph = import_graph()
    assert "hvdtrain.driver" in graph and "hvdtrain.loop" in graph["hvdtrain.session"]
    assert find_cycles(graph) == [], [" -> ".join(cycle) for cycle in find_cycles(graph)]


if __name__ == "__main__":
    graph = import_graph(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else PACKAGE)
    for module in sorted(graph):
        print(f"{module} -> {', '.join(sorted(graph[module])) or '-'}")
    cycles = find_cycles(graph)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, {len(cycles)} cycles")
    for cycle in cycles:
        print("cycle: " + " -> ".join(cycle))

#!/usr/bin/env python3
"""Prints the import graph of the hvdtrain package: per module the hvdtrain modules it imports, and
how many import it (fan-in), biggest hubs first; with --sizes, each module's lines and its longest
functions. Reads the source only (ast), so it runs without the frameworks.

Usage: python scripts/import_graph.py [--root DIR] [--sizes] [--dot]
"""

from __future__ import annotations

import argparse
import ast
from collections import Counter
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """``hvdtrain/torch/engine.py`` -> ``hvdtrain.torch.engine`` (a package's ``__init__`` by its name)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(tree: ast.Module, package: str) -> set[str]:
    """The hvdtrain modules a module's source imports (at any depth, function bodies included)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(package)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
            found.add(node.module)
    return found


def function_sizes(tree: ast.Module) -> list[tuple[int, str]]:
    """(lines, qualified name) of every function and method."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.append((item.end_lineno - item.lineno + 1, f"{node.name}.{item.name}"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.col_offset == 0:
            out.append((node.end_lineno - node.lineno + 1, node.name))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]),
                        help="the checkout whose hvdtrain/ to read (default: this one)")
    parser.add_argument("--sizes", action="store_true", help="module lines and longest functions")
    parser.add_argument("--dot", action="store_true", help="the graph in Graphviz dot")
    args = parser.parse_args()
    root = Path(args.root)
    graph: dict[str, set[str]] = {}
    sizes: dict[str, tuple[int, list[tuple[int, str]]]] = {}
    for path in sorted((root / "hvdtrain").rglob("*.py")):
        tree = ast.parse(path.read_text())
        name = module_name(path, root)
        graph[name] = imports_of(tree, "hvdtrain") - {name}
        sizes[name] = (len(path.read_text().splitlines()), function_sizes(tree))
    if args.dot:
        print("digraph hvdtrain {")
        for name, deps in graph.items():
            for dep in sorted(deps):
                print(f'  "{name}" -> "{dep}";')
        print("}")
        return
    fan_in = Counter(dep for deps in graph.values() for dep in deps)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} import edges")
    print("fan-in  fan-out  module: imports")
    for name in sorted(graph, key=lambda n: (-fan_in[n] - len(graph[n]), n)):
        print(f"{fan_in[name]:6d}  {len(graph[name]):7d}  {name}: {', '.join(sorted(graph[name]))}")
    if args.sizes:
        print("\nlines  longest functions (lines)  module")
        for name, (lines, funcs) in sorted(sizes.items(), key=lambda item: -item[1][0]):
            top = ", ".join(f"{n} {f}" for n, f in sorted(funcs, reverse=True)[:3])
            print(f"{lines:5d}  {name}: {top}")
        counts = sorted(n for _, funcs in sizes.values() for n, _ in funcs)
        if counts:
            print(f"\n{len(counts)} functions: median {counts[len(counts) // 2]} lines, "
                  f"{sum(c <= 15 for c in counts) / len(counts):.0%} of them 15 lines or fewer, "
                  f"longest {counts[-1]}")


if __name__ == "__main__":
    main()

"""The package has no import cycles, counting imports inside functions as well as at the top of a module."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "creditlab"


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its text. `from a import b` with b a module counts
    as importing a.b alone (its parent package is imported by any import of a.b)."""
    files = {}
    for f in root.rglob("*.py"):
        parts = f.relative_to(root.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {m: set() for m in files}
    for module, f in files.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module in files:
                subs = {f"{node.module}.{a.name}" for a in node.names} & files.keys()
                graph[module] |= subs if len(subs) == len(node.names) else subs | {node.module}
            elif isinstance(node, ast.Import):
                graph[module] |= {a.name for a in node.names} & files.keys()
        graph[module].discard(module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycles():
    graph = import_graph()
    assert "creditlab.credit.sources" in graph["creditlab.credit.predictor"]  # the graph sees imports
    assert cycles(graph) == []


def test_a_lazy_import_back_is_a_cycle():
    graph = import_graph()
    graph["creditlab.config"].add("creditlab.credit.sources")  # what importing a source from config would add
    assert any("creditlab.config" in c and "creditlab.credit.sources" in c for c in cycles(graph))


_IMPORT_ALL_WITHOUT_TRITON = """
import importlib, pkgutil, sys
sys.modules["triton"] = None  # an install without Triton: `import triton` raises ImportError
import creditlab
names = [m.name for m in pkgutil.walk_packages(creditlab.__path__, "creditlab.")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def test_every_module_imports_without_triton():
    """The README's main command installs the package without its test extras, so without Triton on a CPU
    machine: every module must import there (a kernel module's Triton-only names stay behind its guard)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL_WITHOUT_TRITON], capture_output=True, text=True,
                          cwd=PACKAGE.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) > 40  # the walk reached the package's modules

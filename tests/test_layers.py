"""The import graph: each layer imports only the layers below it, and no module imports itself back.

Read statically (every `import` in a module, also those inside functions, which are imports all the same
once the function runs), so the test costs no imports and catches a lazy import that closes a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# bottom to top; a layer may import any layer listed before it
LAYERS = ["tasks", "sandbox", "mcp_server", "harness", "synth", "training", "cuda_agent"]
PEERS = {("synth", "training"), ("training", "synth")}  # side by side above the harness: neither may import the other


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for top in LAYERS + ["skills"]:
        for path in (ROOT / top).rglob("*.py"):
            if "examples" in path.parts:  # bundled task files and solutions, not the project's code
                continue
            found[_module_name(path)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports, resolved to the longest known module name."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _layer(module: str) -> str:
    return module.split(".")[0]


def test_layers_import_only_downward():
    bad = []
    for mod, deps in _graph().items():
        here = _layer(mod)
        if here == "skills":
            continue
        for dep in deps:
            there = _layer(dep)
            if there == "skills" or there == here:
                continue
            if (here, there) in PEERS or LAYERS.index(there) > LAYERS.index(here):
                bad.append(f"{mod} imports {dep}")
    assert not bad, "imports that go up or sideways:\n" + "\n".join(sorted(bad))


def test_tasks_is_the_ground_floor():
    deps = {dep for mod, ds in _graph().items() if _layer(mod) == "tasks" for dep in ds}
    assert {_layer(d) for d in deps} <= {"tasks"}, sorted(deps)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            nxt = next((d for d in it if d in graph), None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's __init__ re-exporting its own modules is not a circle: drop edges from a module to
    the package that holds it (`tasks.loader` -> `tasks`), which Python resolves before the module runs."""
    return {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}


def test_no_import_circles():
    cycles = _cycles(_without_package_inits(_graph()))
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("graph, expect", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
])
def test_the_circle_finder_finds_circles(graph, expect):
    assert _cycles(graph) == expect


def test_the_graph_sees_lazy_imports():
    # tasks.loader used to import tasks.ops6k inside functions; ops6k imported loader at the top
    graph = _graph()
    assert "tasks.ops6k" in graph["tasks.loader"] and "tasks.task" in graph["tasks.ops6k"]
    assert "sandbox.confinement.processes" in graph["synth.filter"]  # a function-level import

"""bench/ as a library: every module is either an entry point (a `main` run by `python -m bench...`) or a library
module that entry points import; no entry point imports another, the imports between bench modules have no
circle, and bench/device.sh knows only parts whose modules exist."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(REPO).with_suffix("").parts): p for p in BENCH.rglob("*.py")
            if p.name != "__init__.py"}


def _is_entry(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)


def _bench_imports(tree: ast.Module, names: set[str]) -> set[str]:
    """The bench modules a module imports, wherever the import statement is (module level or inside a function)."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names if a.name in names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("bench"):
            if n.module in names:
                out.add(n.module)
            out |= {f"{n.module}.{a.name}" for a in n.names if f"{n.module}.{a.name}" in names}
    return out


def _graph() -> tuple[dict[str, set[str]], set[str]]:
    mods = _modules()
    trees = {m: ast.parse(p.read_text()) for m, p in mods.items()}
    return {m: _bench_imports(t, set(mods)) for m, t in trees.items()}, {m for m, t in trees.items() if _is_entry(t)}


def test_no_bench_module_imports_an_entry_point():
    graph, entries = _graph()
    bad = {m: sorted(deps & entries) for m, deps in graph.items() if deps & entries}
    assert not bad, f"entry points imported by other modules (move what they share into a library module): {bad}"


def test_bench_imports_have_no_circle():
    graph, _ = _graph()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in graph[m]:
            assert state.get(d) != 1, f"import circle: {' -> '.join(path + [m, d])}"
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_every_entry_point_has_one_main_and_library_modules_have_none():
    _, entries = _graph()
    for m, p in _modules().items():
        tree = ast.parse(p.read_text())
        mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        assert len(mains) == (1 if m in entries else 0), m
    assert {"bench.judge_throughput", "bench.proofs.learns", "bench.proofs.stages"} <= entries


def test_no_script_puts_bench_itself_on_the_path():
    """`sys.path.insert(0, .../bench)` is how scripts imported each other as top-level modules."""
    for p in _modules().values():
        text = p.read_text()
        assert not re.search(r'sys\.path\.insert\(0, str\((REPO / "bench"|Path\(__file__\)\.resolve\(\)\.parent)\)\)',
                             text), p


def test_device_recipe_runs_only_modules_that_exist_and_refuses_an_unknown_part():
    recipe = (BENCH / "device.sh").read_text()
    used = set(re.findall(r"-m (bench(?:\.\w+)+)", recipe))
    assert used and used <= set(_modules()), used - set(_modules())
    listed = subprocess.run(["bash", str(BENCH / "device.sh")], env={"PART": "list", "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, cwd=REPO)
    assert listed.returncode == 0 and listed.stdout.split("\n")[0].startswith("suites")
    names = {line.split()[0] for line in listed.stdout.splitlines() if line.strip() and not line[0].isspace()}
    assert {"suites", "throughput", "loop", "synth"} <= names
    for part in names:  # every listed part has a branch that runs it
        assert re.search(rf"^\s+{part}\)", recipe, re.M), part
    bad = subprocess.run(["bash", str(BENCH / "device.sh")], env={"PART": "suites nope", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "unknown part 'nope'" in bad.stderr


def test_python_m_bench_lists_every_entry_point():
    _, entries = _graph()
    listed = subprocess.run([sys.executable, "-m", "bench"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert listed.returncode == 0, listed.stderr
    shown = {line.split()[2] for line in listed.stdout.splitlines() if line.startswith("python -m ")}
    assert shown == entries - {"bench.__main__"}

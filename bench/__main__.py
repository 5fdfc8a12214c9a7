"""`python -m bench`: every benchmark and proof, one line each (its command and its docstring's first sentence)."""

from __future__ import annotations

import ast
from pathlib import Path

HERE = Path(__file__).resolve().parent


def entry_points() -> list[tuple[str, str]]:
    """(module, summary) for every bench module that runs as `python -m`, in name order (proofs last)."""
    out = []
    for path in sorted(HERE.rglob("*.py"), key=lambda p: (len(p.relative_to(HERE).parts), p.name)):
        if path.name.startswith("__"):
            continue
        tree = ast.parse(path.read_text())
        if not any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body):
            continue
        doc = (ast.get_docstring(tree) or "").strip()
        first = doc.split("\n\n")[0].replace("\n", " ")
        module = ".".join(("bench", *path.relative_to(HERE).with_suffix("").parts))
        out.append((module, first))
    return out


def main() -> None:
    rows = entry_points()
    width = max(len(m) for m, _ in rows)
    for module, summary in rows:
        print(f"python -m {module:<{width}}  {summary}")
    print("\nEach takes --help. docs/benchmarks.md: what each measures and its latest figure; bench/device.sh: GPU parts.")


if __name__ == "__main__":
    main()

"""What a task is: a KernelBench-format model file (`Model`, `get_inputs()`, `get_init_inputs()`),
checked statically. Every loader (files, KernelBench, ops6k, synthesized sets) builds on this module."""

from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass
from pathlib import Path

REQUIRED = ("Model", "get_inputs", "get_init_inputs")


class TaskError(ValueError):
    """A task that cannot be used, with a message naming the problem."""


@dataclass(frozen=True)
class Task:
    id: str
    source: str
    path: Path | None = None

    @property
    def name(self) -> str:
        return self.id.rsplit("/", 1)[-1]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()


def check_source(source: str, origin: str) -> None:
    """Statically check that a task defines what the format requires."""
    try:
        tree = ast.parse(source, filename=origin)
    except SyntaxError as e:
        raise TaskError(f"{origin}: not valid Python: {e.msg} (line {e.lineno})") from None
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    missing = [n for n in REQUIRED if n not in names]
    if missing:
        raise TaskError(f"{origin}: the task does not define {', '.join(missing)} "
                        "(a task needs class Model, get_inputs() and get_init_inputs())")

"""Task selection for rollouts and evaluations.

A spec is one of:
  a task file or a folder of task files       tests/fixtures/cpu_multi/small_task.py, my_tasks/
  a whole suite or level                      kernelbench, kernelbench:level1
  problems of a level by number               kernelbench:level1:1-10, kernelbench:level1:19,21,23-25
  task ids, comma-separated                   kernelbench/level1/19_ReLU,example/swish_bias
  a synthesized set or one split of it        synth:train, synth:eval, synth:runs/synth/dataset/eval
Several specs are joined in order; a task named twice runs once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from tasks import Task, TaskError, list_tasks, load_task

_LEVEL_SELECT = re.compile(r"kernelbench:(level\d+):(.+)")


def _numbers(selector: str, spec: str) -> set[int]:
    out: set[int] = set()
    for part in selector.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise TaskError(f"{spec}: {part!r} is not a problem number or a range like 1-10")
        lo = int(m.group(1))
        hi = int(m.group(2) or lo)
        if hi < lo:
            raise TaskError(f"{spec}: empty range {part}")
        out.update(range(lo, hi + 1))
    return out


def problem_number(task: Task) -> int | None:
    head = task.name.split("_", 1)[0]
    return int(head) if head.isdigit() else None


def level_of(task_id: str) -> str:
    """kernelbench/level1/19_ReLU -> level1; anything else is grouped under its folder or 'other'."""
    parts = task_id.split("/")
    if len(parts) >= 3 and parts[0] == "kernelbench":
        return parts[1]
    return parts[0] if len(parts) >= 2 else "other"


def _one(spec: str) -> list[Task]:
    m = _LEVEL_SELECT.fullmatch(spec)
    if m:
        wanted = _numbers(m.group(2), spec)
        found = [t for t in list_tasks(f"kernelbench:{m.group(1)}") if problem_number(t) in wanted]
        missing = wanted - {problem_number(t) for t in found}
        if missing:
            raise TaskError(f"{spec}: no problem numbered {', '.join(map(str, sorted(missing)))} in {m.group(1)}")
        return found
    if re.fullmatch(r"kernelbench(:level\d+)?", spec) or Path(spec).exists():
        return list_tasks(spec)
    if "," in spec:
        return [t for part in spec.split(",") if part.strip() for t in _one(part.strip())]
    if spec == "synth" or spec.startswith("synth:"):  # a synthesized set, one split (synth:eval) or one task
        return list_tasks(spec)
    return [load_task(spec)]


def select_tasks(specs: str | Iterable[str]) -> list[Task]:
    """The tasks the specs name, in order, each once. Raises TaskError naming a bad spec."""
    items = [specs] if isinstance(specs, str) else list(specs)
    seen: dict[str, Task] = {}
    for spec in items:
        for task in _one(spec.strip()):
            seen.setdefault(task.id, task)
    if not seen:
        raise TaskError(f"no tasks selected by {', '.join(items) or 'an empty spec'}")
    return list(seen.values())

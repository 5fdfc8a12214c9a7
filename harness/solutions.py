"""Finding a task's solution in a folder of solutions, in either of two forms.

Workspace form: a folder with model_new.py and kernels/ (what an agent leaves behind), optionally
one folder per backend (NAME/cuda/, NAME/cpu/).
Single-file form: a KernelBench-style .py whose ModelNew builds its own kernels with
torch.utils.cpp_extension.load_inline. It is converted to workspace form (harness.inline_convert)
so the judge is exactly the one agents face. A file that cannot be converted goes in as it is,
with a placeholder under kernels/ so the build runs, and the judge says what it refuses.

A task `kernelbench/level1/19_ReLU` is looked up as, in order:
  kernelbench/level1/19_ReLU[.py]   level1/19_ReLU[.py]   19_ReLU[.py]
  level1/19[.py]   19[.py]   and KernelBench's own output names: level_1_problem_19_sample_0_kernel.py
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from harness.inline_convert import ConversionError, convert_load_inline
from harness.specs import level_of, problem_number
from tasks import Task

PLACEHOLDER = "kernels/no_kernels.cpp"
PLACEHOLDER_TEXT = ("// This solution builds its kernels itself (torch.utils.cpp_extension.load_inline in\n"
                    "// model_new.py); the sandbox's cuda_extension module is left empty.\n")
SOURCE_SUFFIXES = {".cu", ".cuh", ".cpp", ".cc", ".h", ".hpp", ".c"}
_KB_NAME = re.compile(r"level_?(\d+)_problem_?(\d+)(?:_sample_?(\d+))?", re.I)


@dataclass
class Solution:
    files: dict[str, str]  # workspace-relative path -> text
    origin: str
    form: str  # workspace, load_inline (converted) or single_file (as it is)
    notes: list[str] = field(default_factory=list)


def _workspace_solution(folder: Path, backend: str) -> Solution | None:
    sub = folder / backend
    if (sub / "model_new.py").is_file():
        folder = sub
    model_new = folder / "model_new.py"
    if not model_new.is_file():
        return None
    files = {"model_new.py": model_new.read_text()}
    kernels = folder / "kernels"
    if kernels.is_dir():
        for p in sorted(kernels.rglob("*")):
            if p.is_file() and p.suffix in SOURCE_SUFFIXES:
                files[p.relative_to(folder).as_posix()] = p.read_text()
    if len(files) == 1:
        return _file_solution(model_new)
    return Solution(files=files, origin=str(folder), form="workspace")


def _file_solution(path: Path) -> Solution:
    text = path.read_text()
    try:
        converted = convert_load_inline(text)
    except ConversionError as e:
        return Solution(files={"model_new.py": text, PLACEHOLDER: PLACEHOLDER_TEXT}, origin=str(path),
                        form="single_file", notes=[f"not converted: {e}"])
    return Solution(files=converted.files, origin=str(path), form="load_inline", notes=converted.notes)


def _load(path: Path, backend: str) -> Solution | None:
    if path.is_dir():
        found = _workspace_solution(path, backend)
        if found is None:
            singles = [p for p in path.glob("*.py")]
            if len(singles) == 1:
                return _file_solution(singles[0])
        return found
    if path.is_file() and path.suffix == ".py":
        return _file_solution(path)
    return None


def _candidates(task: Task) -> list[str]:
    level = level_of(task.id)
    names = [task.id, f"{level}/{task.name}", task.name]
    number = problem_number(task)
    if number is not None:
        names += [f"{level}/{number}", str(number)]
    return names


def find_solution(root: Path, task: Task, backend: str) -> Solution | None:
    root = Path(root)
    for name in _candidates(task):
        for path in (root / name, root / f"{name}.py"):
            if path.exists():
                found = _load(path, backend)
                if found is not None:
                    return found
    number = problem_number(task)
    level = level_of(task.id)
    if number is None or not level.startswith("level"):
        return None
    hits = []
    for p in root.rglob("*"):
        m = _KB_NAME.search(p.name)
        if m and f"level{int(m.group(1))}" == level and int(m.group(2)) == number:
            hits.append((int(m.group(3) or 0), p))
    for _, path in sorted(hits, key=lambda h: (h[0], str(h[1]))):
        found = _load(path, backend)
        if found is not None:
            return found
    return None

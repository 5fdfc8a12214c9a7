"""Load KernelBench-format tasks: a file with `Model`, `get_inputs()` and `get_init_inputs()`.

Loading is static (parse, no execution) so listing a suite of hundreds of tasks is instant;
`sandbox.correctness.taskcheck` executes a task safely in a subprocess when it is used.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

from tasks import kernelbench
from tasks.ops6k import load_ops6k, ops6k_task
from tasks.synthset import is_set, shipped_root, synth_task, synth_tasks
from tasks.task import Task, TaskError, check_source

EXAMPLES_DIR = Path(__file__).parent / "examples"


def library_task(source: bytes) -> bool:
    """Whether a task's source is one the project ships or pins: a bundled example, or a KernelBench problem
    whose bytes match the manifest's checksum. Only such a task's baseline may compile with the judge's
    shared torch.compile cache: any other (an MCP client's `source`, a synthesized task) runs code nobody
    vetted, and must not be able to leave compiled entries that another task's baseline would load."""
    digest = hashlib.sha256(source).hexdigest()
    if digest in _library_digests():
        return True
    return any(hashlib.sha256(p.read_bytes()).hexdigest() == digest for p in EXAMPLES_DIR.glob("*.py"))


@functools.cache
def _library_digests() -> frozenset[str]:
    return frozenset(kernelbench.load_manifest().values())


def kernelbench_root() -> Path:
    """Where the KernelBench levels live, the first folder that exists of: $CUDA_AGENT_KERNELBENCH
    (else ../shared/kernelbench), then the cache that `cuda-agent tasks download kernelbench` fills.

    When none exists, the first candidate is returned, and callers report it with the download command.
    """
    cands = kernelbench_candidates()
    return next((c for c in cands if c.is_dir()), cands[0])


def kernelbench_candidates() -> list[Path]:
    env = os.environ.get("CUDA_AGENT_KERNELBENCH")
    here = Path(__file__).resolve().parent.parent
    first = [Path(env)] if env else [here.parent / "shared" / "kernelbench", here / "shared" / "kernelbench"]
    return [*first, kernelbench.installed_root()]


def _no_suite(what: str) -> TaskError:
    looked = ", ".join(str(c) for c in kernelbench_candidates())
    return TaskError(f"no KernelBench {what}: " + kernelbench.missing_suite_message(f"looked in {looked}"))


def _from_file(path: Path, task_id: str) -> Task:
    try:
        source = path.read_text()
    except OSError as e:
        raise TaskError(f"cannot read task file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise TaskError(f"task file {path} is not UTF-8 text") from None
    check_source(source, str(path))
    # absolute, so workers started in another directory find it
    return Task(id=task_id, source=source, path=path.resolve())


def _kernelbench_file(level: str, name: str) -> Path:
    root = kernelbench_root()
    folder = root / level
    if not folder.is_dir():
        raise _no_suite(level)
    exact = folder / f"{name}.py"
    if exact.is_file():
        return exact
    # accept just the problem number ("kernelbench/level1/19") or the name without the number
    hits = [p for p in folder.glob("*.py") if p.stem.split("_", 1)[0] == name or p.stem.split("_", 1)[-1] == name]
    if len(hits) == 1:
        return hits[0]
    raise TaskError(f"unknown KernelBench task {level}/{name}")


def load_task(spec: str | Path) -> Task:
    """A task from a file path, `kernelbench/levelN/NAME` (or NUMBER), `example/NAME`, `ops6k:NAME` or
    `synth:[FOLDER/][SPLIT/]NAME` (a synthesized set, tasks.synthset)."""
    spec_s = str(spec)
    p = Path(spec_s)
    if p.is_file():
        return _from_file(p, p.stem)
    m = re.fullmatch(r"kernelbench[/:](level\d)/([\w.-]+?)(\.py)?", spec_s)
    if m:
        path = _kernelbench_file(m.group(1), m.group(2))
        return _from_file(path, f"kernelbench/{m.group(1)}/{path.stem}")
    if spec_s.startswith(("ops6k:", "ops6k/")):  # the released training set (tasks.ops6k)
        return ops6k_task(spec_s[6:])
    if spec_s.startswith("synth:"):
        return synth_task(spec_s[6:])
    m = re.fullmatch(r"examples?/([\w.-]+?)(\.py)?", spec_s)
    if m and (EXAMPLES_DIR / f"{m.group(1)}.py").is_file():
        return _from_file(EXAMPLES_DIR / f"{m.group(1)}.py", f"example/{m.group(1)}")
    if p.suffix == ".py" or os.sep in spec_s:
        raise TaskError(f"task file not found: {spec_s}")
    raise TaskError(f"unknown task {spec_s!r}: give a .py file, kernelbench/levelN/NAME or example/NAME")


def _level_sort_key(p: Path) -> tuple[int, str]:
    head = p.stem.split("_", 1)[0]
    return (int(head) if head.isdigit() else 1 << 30, p.stem)


def example_tasks() -> list[Task]:
    return [_from_file(f, f"example/{f.stem}") for f in sorted(EXAMPLES_DIR.glob("*.py"))]


def available_tasks() -> tuple[list[Task], list[str]]:
    """Every task this install can open without a download: the bundled examples, the shipped synthesized set
    (`synth:train/...`, `synth:eval/...`) and KernelBench where it was fetched; and a line for each source that
    is not there, saying how to get it. What `cuda-agent tasks` with no argument lists."""
    found, missing = example_tasks(), []
    if is_set(shipped_root()):
        found += synth_tasks("")
    else:
        missing.append(f"no synthesized set at {shipped_root()}")
    try:
        found += list_tasks("kernelbench")
    except TaskError:
        missing.append("KernelBench is not downloaded: `cuda-agent tasks download kernelbench`")
    return found, missing


def list_tasks(spec: str | Path) -> list[Task]:
    """Tasks from a folder (a synthesized set too), a file, `kernelbench` (all levels), `kernelbench:levelN`,
    `ops6k`, or `synth` / `synth:...` (a synthesized set, one split of it, or one task: tasks.synthset)."""
    spec_s = str(spec)
    m = re.fullmatch(r"kernelbench(?::(level\d))?", spec_s)
    if m:
        root = kernelbench_root()
        levels = [m.group(1)] if m.group(1) else sorted(d.name for d in root.glob("level*") if d.is_dir())
        if not levels:
            raise _no_suite("levels")
        out: list[Task] = []
        for level in levels:
            folder = root / level
            if not folder.is_dir():
                raise _no_suite(level)
            for f in sorted(folder.glob("*.py"), key=_level_sort_key):
                out.append(_from_file(f, f"kernelbench/{level}/{f.stem}"))
        return out
    if spec_s == "ops6k":
        return list(load_ops6k(None)[0])
    if spec_s == "synth" or spec_s.startswith("synth:"):
        return synth_tasks(spec_s[6:])
    p = Path(spec_s)
    if p.is_dir():
        if is_set(p) and not any(p.glob("*.py")):
            return synth_tasks(spec_s)
        return [_from_file(f, f"{p.name}/{f.stem}") for f in sorted(p.glob("*.py"), key=_level_sort_key)]
    return [load_task(spec_s)]

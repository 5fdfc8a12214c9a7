"""Synthesized task sets (`cuda-agent synth build`, `synth package`) as `synth:` task ids.

A set folder holds one JSON-lines file per split, `train.jsonl.gz` and `eval.jsonl.gz` (a folder written
before the splits holds one `tasks.jsonl`, all of it train), read here with the standard library alone:
a plain clone lists and opens the set shipped with the project with no `datasets`, no network and no
../shared. The same folder also holds the `datasets` save_to_disk files, which this module never reads.

Ids and specs (FOLDER/ left out: the shipped set, `tasks/synth_set` or $CUDA_AGENT_SYNTH_SET):
  synth  or  synth:                the whole shipped set (`cuda-agent tasks synth`)
  synth:eval, synth:train          one split of it
  synth:eval/TASK_ID               one task; synth:TASK_ID finds it in whichever split holds it
  synth:FOLDER, synth:FOLDER/eval, synth:FOLDER/eval/TASK_ID, synth:FOLDER/TASK_ID   the same for a built set
  synth:BUILD/5-selfcheck/TASK_ID  a task file of any stage folder of a build
A task's id is always the canonical `synth:[FOLDER/]SPLIT/TASK_ID`, however it was named, so results
keyed by task id say which split a task came from.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from tasks.task import Task, TaskError, check_source

SPLITS = ("train", "eval")
LEGACY_ROWS = "tasks.jsonl"
SHIPPED_DIR = Path(__file__).parent / "synth_set"


def split_file(split: str) -> str:
    return f"{split}.jsonl.gz"


def shipped_root() -> Path:
    env = os.environ.get("CUDA_AGENT_SYNTH_SET")
    return Path(env) if env else SHIPPED_DIR


def is_set(folder: Path) -> bool:
    return any((folder / split_file(s)).is_file() for s in SPLITS) or (folder / LEGACY_ROWS).is_file()


def read_split(folder: Path, split: str) -> list[dict]:
    """The rows of one split, each with its `split`."""
    path = folder / split_file(split)
    if path.is_file():
        text = gzip.decompress(path.read_bytes()).decode()
    elif split == "train" and (folder / LEGACY_ROWS).is_file():
        text = (folder / LEGACY_ROWS).read_text()
    else:
        return []
    return [{**json.loads(line), "split": split} for line in text.splitlines() if line.strip()]


def set_rows(folder: Path) -> list[dict]:
    if not is_set(folder):
        raise TaskError(f"{folder} is not a synthesized set folder (no {split_file('train')}, "
                        f"{split_file('eval')} or {LEGACY_ROWS})")
    return [r for s in SPLITS for r in read_split(folder, s)]


def _no_shipped() -> TaskError:
    return TaskError(f"no synthesized set is shipped at {shipped_root()}: build one with `cuda-agent synth build "
                     "--out BUILD` and `cuda-agent synth package --out BUILD`, or name a folder: synth:FOLDER")


def _resolve(spec: str) -> tuple[Path, str, str | None, str | None]:
    """(set folder, id prefix, split or None, task id or None) of a spec after `synth:`; a stage folder's task
    file comes back as (its folder, prefix, None, name) with the folder not a set."""
    s = spec.strip().rstrip("/")
    if not s:
        return shipped_root(), "", None, None
    if is_set(Path(s)):
        return Path(s), s + "/", None, None
    head, _, last = s.rpartition("/")
    # a split's name is the shipped set's split, never a folder of the working directory: `synth:eval/ID` opens
    # the same task wherever it is asked for (an MCP server's task ids read nothing else of its disk)
    if head and head not in SPLITS and (Path(head) / f"{last}.py").is_file():
        return Path(head), head + "/", None, last
    if last in SPLITS and (not head or is_set(Path(head))):
        return (Path(head), head + "/", last, None) if head else (shipped_root(), "", last, None)
    parent, _, split = head.rpartition("/")
    if split in SPLITS and (not parent or is_set(Path(parent))):
        return (Path(parent), parent + "/", split, last) if parent else (shipped_root(), "", split, last)
    if head and is_set(Path(head)):
        return Path(head), head + "/", None, last
    if not head:
        return shipped_root(), "", None, last
    raise TaskError(f"synth:{spec}: {head} is not a synthesized set folder (no {split_file('train')})")


def _task(prefix: str, row: dict) -> Task:
    tid = f"synth:{prefix}{row['split']}/{row['task_id']}"
    check_source(row["code"], tid)
    return Task(id=tid, source=row["code"])


def synth_tasks(spec: str) -> list[Task]:
    """The tasks a spec names (after `synth:`): a set, a split, or one task."""
    folder, prefix, split, name = _resolve(spec)
    path = folder / f"{name}.py"
    if name is not None and not is_set(folder) and path.is_file():  # a stage folder's task file
        source = path.read_text()
        check_source(source, str(path))
        return [Task(id=f"synth:{prefix}{name}", source=source, path=path.resolve())]
    if not is_set(folder):
        raise _no_shipped() if prefix == "" else TaskError(f"{folder} is not a synthesized set folder")
    rows = read_split(folder, split) if split else set_rows(folder)
    if name is None:
        return [_task(prefix, r) for r in rows]
    hits = [r for r in rows if r["task_id"] == name]
    if not hits:
        where = f"the {split} split of " if split else ""
        raise TaskError(f"unknown synthesized task {name!r} in {where}{folder}")
    return [_task(prefix, hits[0])]


def synth_task(spec: str) -> Task:
    """One task (`synth:[FOLDER/][SPLIT/]TASK_ID` after the prefix)."""
    if _resolve(spec)[3] is None:
        raise TaskError(f"synth:{spec} names a set or a split, not a task: list it with `cuda-agent tasks synth:{spec}`")
    return synth_tasks(spec)[0]

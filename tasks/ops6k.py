"""CUDA-Agent-Ops-6K, the paper's released training tasks, as `ops6k:` task ids.

Where the rows come from, first found wins:
  $CUDA_AGENT_OPS6K  a local copy: a parquet file, a folder of parquet files, or a `save_to_disk` folder
  the hub            `datasets.load_dataset(HUB_ID, split="train")` (needs the `datasets` package and network)
A row's task code is read from the first column that exists among CODE_COLUMNS and its name from
ID_COLUMNS (else its row number), so a copy in our own export schema (`id`, `code`: what
`cuda-agent synth build` writes) loads the same way. Rows whose code is not a KernelBench task
(no Model / get_inputs / get_init_inputs) are skipped with a count, not an error.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path

from tasks.task import Task, TaskError, check_source

HUB_ID = "BytedTsinghua-SIA/CUDA-Agent-Ops-6K"
CODE_COLUMNS = ("code", "pytorch_code", "torch_code", "reference_code", "source", "task", "program", "python")
ID_COLUMNS = ("id", "task_id", "problem_id", "name", "op_name")


def _dataset(source: str | None):
    try:
        import datasets
    except ImportError:
        raise TaskError("ops6k needs the datasets package: pip install 'cuda-agent[synth]'") from None
    src = source or os.environ.get("CUDA_AGENT_OPS6K")
    if src:
        p = Path(src)
        if (p / "dataset_info.json").is_file() or (p / "state.json").is_file():
            return datasets.load_from_disk(str(p))
        if (p / "dataset_dict.json").is_file():  # splits (a `synth build` set: train and eval), read as one
            parts = datasets.load_from_disk(str(p))
            return datasets.concatenate_datasets([parts[k] for k in parts])
        files = [str(p)] if p.is_file() else sorted(str(f) for f in p.glob("**/*.parquet"))
        if not files:
            raise TaskError(f"no ops6k copy at {p}: give a parquet file, a folder of them, or a save_to_disk folder")
        return datasets.load_dataset("parquet", data_files=files, split="train")
    try:
        return datasets.load_dataset(HUB_ID, split="train")
    except Exception as e:
        raise TaskError(f"cannot load {HUB_ID} from the hub ({type(e).__name__}: {str(e)[:200]}); "
                        "set CUDA_AGENT_OPS6K to a local copy") from None


def _name(value, index: int) -> str:
    return re.sub(r"[^\w.-]+", "_", str(value)).strip("_") or str(index)


@lru_cache(maxsize=2)
def load_ops6k(source: str | None = None) -> tuple[tuple[Task, ...], int]:
    """(tasks, rows skipped because their code is not a KernelBench task)."""
    ds = _dataset(source)
    cols = set(ds.column_names)
    code_col = next((c for c in CODE_COLUMNS if c in cols), None)
    if code_col is None:
        raise TaskError(f"ops6k: no code column among {', '.join(CODE_COLUMNS)} (columns: {', '.join(sorted(cols))})")
    id_col = next((c for c in ID_COLUMNS if c in cols), None)
    tasks, skipped = [], 0
    for i, row in enumerate(ds):
        name = _name(row[id_col], i) if id_col else str(i)
        try:
            check_source(row[code_col] or "", f"ops6k:{name}")
        except TaskError:
            skipped += 1
            continue
        tasks.append(Task(id=f"ops6k/{name}", source=row[code_col]))
    return tuple(tasks), skipped


def ops6k_task(name: str) -> Task:
    for t in load_ops6k(None)[0]:
        if t.name == name:
            return t
    raise TaskError(f"unknown ops6k task {name!r}")

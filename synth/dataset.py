"""The set as a dataset folder: `tasks.jsonl` (always), the `datasets` save_to_disk files (where the
package is importable), `report.json` and a README.md dataset card.

The build machine need not have `datasets` (the GPU device does not): the JSON lines hold every column,
and `cuda-agent synth card --out BUILD` run later where `datasets` is installed adds the Arrow files
from them, so the folder then loads with `datasets.load_from_disk`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from synth.report import eager_of, make_report, report_lines, set_rows

DATASET = "dataset"
ROWS = "tasks.jsonl"
LICENSE = "apache-2.0"
COLUMNS = ("task_id", "code", "ops", "libraries", "fusion_depth", "origin", "backend", "eager_ms",
           "nearest_kernelbench", "score")


def dataset_rows(build: Path, backend: str) -> list[dict]:
    rows = []
    for r in set_rows(build):
        near = r.get("nearest") or {}
        source = (build / "5-selfcheck" / r["file"]).read_text()
        rows.append({"task_id": r["id"], "code": source, "ops": list(r.get("ops") or []),
                     "libraries": list(r.get("libraries") or []), "fusion_depth": len(r.get("ops") or []),
                     "origin": r.get("origin", ""), "backend": backend, "eager_ms": eager_of(r),
                     "nearest_kernelbench": near.get("problem") or "", "score": float(near.get("score") or 0.0)})
    return rows


def write_dataset(build: Path, backend: str, band_ms: tuple[float, float], threshold: float) -> dict:
    """(Re)write BUILD/dataset from the build's folders; returns where and what it wrote."""
    folder = build / DATASET
    folder.mkdir(parents=True, exist_ok=True)
    rows = dataset_rows(build, backend)
    with open(folder / ROWS, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    rep = make_report(build, band_ms)
    rep.update(backend=backend, threshold=threshold)
    (folder / "report.json").write_text(json.dumps(rep, indent=2))
    arrow, note = False, None
    try:
        from datasets import Dataset
    except ImportError:
        note = ("datasets is not importable here: tasks.jsonl holds every column; run `cuda-agent synth card "
                f"--out {build}` where it is to add the save_to_disk files")
    else:
        from datasets.table import InMemoryTable

        # the fingerprint is the rows' own hash: the same set gets the same one on every machine, and datasets'
        # default (dill over the dataset's state) hit Python's recursion limit inside a long test process
        fingerprint = hashlib.sha256((folder / ROWS).read_bytes()).hexdigest()[:16]
        table = InMemoryTable.from_pydict({k: [r.get(k) for r in rows] for k in COLUMNS})
        Dataset(table, fingerprint=fingerprint).save_to_disk(str(folder))
        arrow = True
    # after save_to_disk, which owns the folder's other files
    (folder / "README.md").write_text(card(rep, len(rows), band_ms, threshold, backend))
    return {"rows": len(rows), "dataset": str(folder), "arrow": arrow, "note": note, "report": rep}


def _size_category(n: int) -> str:
    for bound, label in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K")):
        if n < bound:
            return label
    return "100K<n<1M"


def card(rep: dict, n: int, band_ms: tuple[float, float], threshold: float, backend: str) -> str:
    lo, hi = band_ms
    stats = "\n".join(f"- {line}" for line in report_lines(rep))
    top = "\n".join(f"| `{op}` | {c} |" for lib in ("torch", "transformers")
                    for op, c in list(rep["operators"]["counts"][lib].items())[:15])
    return f"""---
license: {LICENSE}
task_categories:
- text-generation
language:
- en
tags:
- code
- cuda
- pytorch
- kernelbench-format
pretty_name: cuda-agent synthesized kernel tasks
size_categories:
- {_size_category(n)}
configs:
- config_name: default
  data_files:
  - split: train
    path: {ROWS}
---

# cuda-agent synthesized kernel tasks

{n} PyTorch reference models in the KernelBench format (`Model`, `get_inputs()`, `get_init_inputs()`),
each a fusion of torch and transformers operators, for training agents that write CUDA kernels. Built
with `cuda-agent synth build` on the `{backend}` backend; `report.json` holds every number below.

## Columns

`task_id`, `code` (the task's source), `ops` (its operators, e.g. `torch.nn.GELU`), `libraries`,
`fusion_depth` (how many operators it fuses), `origin`, `backend`, `eager_ms` (the judge's eager time),
`nearest_kernelbench` (the closest KernelBench level 1-3 problem by computation) and `score` (the
similarity to it).

Load with `datasets.load_from_disk(FOLDER)` (after `cuda-agent synth card` where the build machine
lacked `datasets`), `datasets.load_dataset("json", data_files="FOLDER/tasks.jsonl")`, or by the
project's task ids:
`cuda-agent init synth:FOLDER/TASK_ID ws/`.

## How it was made

1. crawl: operators of torch (`torch.nn.functional`, `torch.nn` modules, tensor ops) and transformers
   (activations, RMSNorms, rotary embeddings, gated MLPs, inlined) found by introspection and recipes;
2. compose: 2 to 5 operators fused into one model by shape rules;
3. filter: each task run in an isolated worker, kept if it builds, is finite, deterministic, sensitive
   to every input, compiles under `torch.compile` and runs in the eager band;
4. decontaminate: dropped when it computes what a KernelBench problem computes (below);
5. self-check: kept only if the judge can judge it (below).

## Decontamination

By computation: every task's forward is traced to its ATen ops (argument roles, dtypes, shape
relations) and normalized (module and functional forms, aliases and decompositions, names, constants
and sizes do not count), then compared with every KernelBench level 1-3 problem. A task scoring
{threshold} or more against any problem is dropped; the textual similarity is kept as a second opinion.
Each row records its nearest problem and score.

## Self-check

Every task passed the judge's own self-check before entering the set: its reference verified against
itself through the real judge (builds, runs, gives the same outputs across trials and seeds), and its
eager time measured by the judge's timing protocol within {lo:g}-{hi:g} ms. Failures are counted by
reason under the `selfcheck` stage below.

## Statistics

{stats}

| most used operators | tasks |
|---|---|
{top}

## License

{LICENSE}: the generated code is the project's; the operators it calls belong to PyTorch (BSD-3-Clause)
and the inlined transformers code to Hugging Face transformers (Apache-2.0).
"""
